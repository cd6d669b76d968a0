"""RLHF algorithms as pure torch functions, and the interfaces that bind them to graph calls."""

from rayhf.algorithms import (  # noqa: F401  (importing registers the interfaces)
    lm,
    offline_interfaces,
    ppo_interfaces,
    reward,
    rl_interfaces,
)
from rayhf.algorithms.interface import (
    INTERFACES,
    CallContext,
    Interface,
    InterfaceSettings,
    make_interface,
)

__all__ = ["INTERFACES", "CallContext", "Interface", "InterfaceSettings", "make_interface"]
