"""Environments and tools for multi-turn rollouts: the tool registry, tool-call parsing and the
built-in tools (``tools``), and the sandboxed code runner (``sandbox``)."""
