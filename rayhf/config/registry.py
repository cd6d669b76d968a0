"""The registry of algorithms and of the interfaces a graph may name, listed explicitly:
importing this module is what makes the tables (no module registers itself on import).

    ALGORITHMS   name -> ``Algorithm`` (its config section and interfaces), one row per module
    INTERFACES   interface name -> class: the algorithms' and the shared ones (``lm``,
                 ``reward``, ``judge``)

It sits in the config layer because GRPO's and PPO's multi-turn agents live in ``rayhf.envs``,
above the algorithms: they join their algorithm's row here. The experiment config's
``algorithm:`` union is built from ``ALGORITHMS``.
"""

from __future__ import annotations

from collections.abc import Iterable

from rayhf.algorithms import (
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
from rayhf.algorithms.interface import Algorithm, Interface, InterfaceSettings
from rayhf.envs import agent

DEFAULT_ALGORITHM = "ppo"  # an ``algorithm:`` section without a ``name``

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        ppo.ALGORITHM.with_interfaces(agent.PPOAgentInterface),
        grpo.ALGORITHM.with_interfaces(agent.GRPOAgentInterface),
        rloo.ALGORITHM,
        gspo.ALGORITHM,
        dapo.ALGORITHM,
        reinforce_pp.ALGORITHM,
        remax.ALGORITHM,
        dpo.ALGORITHM,
        rm.ALGORITHM,
        sft.ALGORITHM,
    )
}

# interfaces of no one algorithm: any algorithm's graph may name them
SHARED_INTERFACES: tuple[type[Interface], ...] = (
    lm.LMInterface,
    reward.RewardInterface,
    judge.JudgeInterface,
)


def interface_table(
    algorithms: Iterable[Algorithm], shared: Iterable[type[Interface]] = SHARED_INTERFACES
) -> dict[str, type[Interface]]:
    """Interface name -> class over ``algorithms``' interfaces and ``shared``; a name taken
    twice is a registration mistake."""
    table: dict[str, type[Interface]] = {}
    for cls in [c for a in algorithms for c in a.interfaces] + list(shared):
        assert cls.name not in table, f"interface name '{cls.name}' registered twice"
        table[cls.name] = cls
    return table


INTERFACES: dict[str, type[Interface]] = interface_table(ALGORITHMS.values())


def make_interface(name: str, settings: InterfaceSettings) -> Interface:
    return INTERFACES[name](settings)
