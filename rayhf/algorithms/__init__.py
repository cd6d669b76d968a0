"""RLHF algorithms, one module per algorithm, and the interfaces that bind them to graph calls.

Each algorithm module (``ppo``, ``grpo``, ``rloo``, ``gspo``, ``dapo``, ``reinforce_pp``, ``remax``,
``dpo``, ``rm``, ``sft``) holds its config, its math as pure torch functions and its interfaces,
and exports its registration, ``ALGORITHM``; ``judge`` makes a causal LM's verdict a reward;
``interface`` (the base class and the ``Algorithm`` row), ``lm``, ``offline``, ``reward`` and
``seqs`` are the pieces they share. ``rayhf.config.registry`` lists the algorithms and every
interface a graph may name (importing this package registers nothing).
"""

from rayhf.algorithms.interface import (
    Algorithm,
    CallContext,
    Interface,
    InterfaceSettings,
)
from rayhf.algorithms.reward import resolve_function

__all__ = [
    "Algorithm",
    "CallContext",
    "Interface",
    "InterfaceSettings",
    "resolve_function",
]
