"""Environments and tools for multi-turn rollouts: the sandboxed code runner (``sandbox``)."""
