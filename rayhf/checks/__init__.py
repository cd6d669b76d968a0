"""Harnesses that spawn processes to prove parity and bit-exactness (not core code)."""
