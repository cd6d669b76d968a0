"""RLHF algorithms, one module per algorithm, and the interfaces that bind them to graph calls.

Each algorithm module (``ppo``, ``grpo``, ``rloo``, ``gspo``, ``dapo``, ``reinforce_pp``, ``remax``,
``dpo``, ``rm``, ``sft``) holds its config, its math as pure torch functions and its interfaces;
``judge`` makes a causal LM's verdict a reward;
``interface`` (the base class and registry), ``lm``, ``offline``, ``reward`` and ``seqs`` are the
pieces they share. Importing this package registers every interface in ``INTERFACES``.
"""

from rayhf.algorithms import (  # noqa: F401  (importing registers the interfaces)
    dapo,
    dpo,
    grpo,
    gspo,
    judge,
    lm,
    ppo,
    reinforce_pp,
    remax,
    reward,
    rloo,
    rm,
    sft,
)
from rayhf.algorithms.interface import (
    INTERFACES,
    CallContext,
    Interface,
    InterfaceSettings,
    make_interface,
)
from rayhf.algorithms.reward import resolve_function

__all__ = [
    "INTERFACES",
    "CallContext",
    "Interface",
    "InterfaceSettings",
    "make_interface",
    "resolve_function",
]
