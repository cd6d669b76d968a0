"""RLHF algorithms as pure torch functions, and the interfaces that bind them to graph calls."""

from rayhf.algorithms import ppo_interfaces, reward  # noqa: F401  (register the interfaces)
from rayhf.algorithms.interface import (
    INTERFACES,
    CallContext,
    Interface,
    InterfaceSettings,
    make_interface,
)

__all__ = ["INTERFACES", "CallContext", "Interface", "InterfaceSettings", "make_interface"]
