"""Hand-written placements that the search must beat, as plans in the same format.

- ``colocated`` (verl-style): every call on all devices in one shared layout, no reallocation.
- ``disjoint`` (OpenRLHF-style): each role on its own devices in proportion to its size,
  generation on the actor's devices.
- ``realhf`` (ReaLHF's PPO heuristic from its public code; see the issue text for the rules).

Each gets the same tuning the search gets: among the layouts its rule allows (tp a power of two
within a node, pp any divisor of what tp leaves, micro-batches), the one with the lowest
simulated time is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from rayhf.graph import Graph
from rayhf.models.sharding import check_layout, param_shards
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.plan import Plan
from rayhf.planner.search import MICRO_BATCHES, _divisors, _powers

Score = Callable[[Plan], float]


def _layouts_on(mesh: tuple[int, ...], spec: ModelSpec | None, per_node: int) -> list[Layout]:
    if spec is None:
        return [Layout(mesh, dp=len(mesh))]
    out = []
    for tp in _powers(min(len(mesh), per_node)):
        for pp in _divisors(len(mesh) // tp) if len(mesh) % tp == 0 else []:
            if check_layout(spec, tp, pp) is None:
                for n_mbs in MICRO_BATCHES if pp > 1 else (1,):
                    out.append(Layout(mesh, len(mesh) // (tp * pp), tp, pp, n_mbs))
    return out


def _model_takes(plan: Plan, graph: Graph, specs: Mapping[str, ModelSpec]) -> bool:
    """Whether every call's model can take its layout (heads over tp, layers over pp)."""
    return all(
        specs.get(c.role) is None
        or check_layout(specs[c.role], plan.layouts[c.name].tp, plan.layouts[c.name].pp) is None
        for c in graph.calls
    )


def _tune(plans: list[Plan], score: Score) -> Plan:
    return min(plans, key=score)


def colocated(graph: Graph, specs: Mapping[str, ModelSpec], n: int, per_node: int, score):
    """Every call on every device, one layout for all (the best such layout)."""
    largest = max((s for s in specs.values() if s is not None), key=_size)
    options = _layouts_on(tuple(range(n)), largest, per_node)
    fits_all = [
        lay for lay in options
        if all(s is None or check_layout(s, lay.tp, lay.pp) is None for s in specs.values())
    ]  # fmt: skip
    plans = [Plan({c.name: lay for c in graph.calls}, "colocated") for lay in fits_all]
    return _tune(plans, score)


def _size(spec: ModelSpec) -> int:
    return sum(p.numel for p in param_shards(spec))


def disjoint(graph: Graph, specs: Mapping[str, ModelSpec], n: int, per_node: int, score):
    """Roles on disjoint device blocks proportional to their sizes (with more roles than
    devices, one device each, wrapping around); each role tuned in turn while the others stay
    on their own blocks (at first sharded the most, so they fit)."""
    roles = [r for r in graph.roles if specs.get(r) is not None]
    sizes = {r: _size(specs[r]) for r in roles}  # type: ignore[arg-type]
    total = sum(sizes.values())
    share = {r: max(1, 2 ** int(math.log2(max(1, n * sizes[r] / total)))) for r in roles}
    while sum(share.values()) > n and max(share.values()) > 1:
        biggest = max(share, key=lambda r: share[r])
        share[biggest] //= 2
    start, meshes = 0, {}
    for r in sorted(roles, key=lambda r: -share[r]):
        start = start if start + share[r] <= n else 0  # more roles than devices: they share
        meshes[r] = tuple(range(start, start + share[r]))
        start += share[r]
    fixed: dict[str, Layout] = {}
    for c in graph.calls:
        if specs.get(c.role) is None:
            fixed[c.name] = Layout((0,), dp=1)
    options = {r: _layouts_on(meshes[r], specs[r], per_node) for r in roles}
    for r in roles:  # until tuned, each role on its own devices, sharded the most (least memory)
        most = max(options[r], key=lambda lay: (lay.tp * lay.pp, lay.n_mbs))
        fixed.update(dict.fromkeys(graph.role_calls(r), most))
    for r in roles * 2:  # then each role tuned in turn, the others where they are; twice, so
        trials = [  # the first roles are tuned again against the others' tuned layouts
            Plan({**fixed, **dict.fromkeys(graph.role_calls(r), lay)}, "disjoint")
            for lay in options[r]
        ]
        fixed = dict(_tune(trials, score).layouts)
    return Plan({c.name: fixed[c.name] for c in graph.calls}, "disjoint")


def realhf(graph: Graph, specs: Mapping[str, ModelSpec], n_nodes: int, per_node: int, score):
    """ReaLHF's PPO heuristic (its public ``realhf/experiments/common/ppo_exp.py`` rules), for
    nodes of 8 devices; None for other graphs or node sizes."""
    if per_node != 8 or not {"actor_gen", "actor_train", "critic_train"} <= set(graph.by_name):
        return None
    plans = [_realhf_plan(graph, specs, n_nodes, n_mbs) for n_mbs in MICRO_BATCHES]
    plans = [p for p in plans if _model_takes(p, graph, specs)]
    return _tune(plans, score) if plans else None  # its fixed tp/pp exceed a small model


def _realhf_plan(graph: Graph, specs: Mapping[str, ModelSpec], n_nodes: int, n_mbs: int):
    n = 8 * n_nodes
    every = tuple(range(n))
    actor, critic = specs.get("actor"), specs.get("critic")
    a = _size(actor) if actor is not None else 1
    c = _size(critic) if critic is not None else 1
    gen_pp = max(2, n_nodes)
    lay = {"actor_gen": Layout(every, n // gen_pp, 1, gen_pp, n_mbs)}
    if n_nodes == 1:
        first, second = tuple(range(4)), tuple(range(4, 8))
        tp = 4 if a > 8e9 else 2
        lay["actor_train"] = Layout(first, 4 // tp, tp, 1, n_mbs)
        lay["critic_train"] = Layout(second, 4 // tp, tp, 1, n_mbs)
        lay["rew_inf"], lay["critic_inf"] = Layout(first, 2, 2), Layout(second, 2, 2)
        lay["ref_inf"] = Layout(every, 4, 2)
    else:
        actor_nodes = min(n_nodes - 1, math.ceil(n_nodes * a / (a + c)))
        blocks = {
            "actor_train": tuple(range(8 * actor_nodes)),
            "critic_train": tuple(range(8 * actor_nodes, n)),
            "ref_inf": every,
            "rew_inf": tuple(range(n // 2)),
            "critic_inf": tuple(range(n // 2, n)),
        }
        for name, mesh in blocks.items():
            lay[name] = Layout(mesh, 2, 4, len(mesh) // 8, n_mbs)
    return Plan({call.name: lay[call.name] for call in graph.calls}, "realhf")
