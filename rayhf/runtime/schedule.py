"""One step of the graph as units of work and the order between them (pure: no Ray).

    graph calls in topological order
      -> units: each call on its role group; a weight move "realloc:<call>" before a call whose
         layout is not its role's home layout; a blend "ema:<role>" after a train call into each
         role that follows it by moving average
      -> each unit runs after: the calls whose keys it reads, the previous unit on every device
         it uses (calls sharing devices run in graph order), and, for a train call or a blend,
         every earlier unit of its role (a role trains on the weights its step used: on-policy)

Units on disjoint devices with no path between them run at the same time. A role's train call
of step i finishes before step i+1 begins because the driver runs one step at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from rayhf.graph import Graph
from rayhf.parallel.layout import Layout


def group_key(role: str, layout: Layout) -> str:
    """The role group that holds ``role`` in ``layout`` (names its actors and transfer groups)."""
    return f"{role}.{layout.name}"


@dataclass(frozen=True)
class Unit:
    """A call on its role group, or a weight move between two role groups."""

    name: str  # the call, "realloc:<call>" or "ema:<role>"
    kind: Literal["call", "realloc"]
    role: str  # the role whose weights it uses (a move: the role that receives them)
    groups: tuple[str, ...]  # group keys taking part: (the call's group,) or (source, destination)
    devices: frozenset[int]
    after: frozenset[str]  # units that must finish first
    sources: tuple[str, ...] = ()  # a call: the calls whose outputs it reads, in graph order
    eta: float | None = None  # a blend: dst = eta * src + (1 - eta) * dst
    release: bool = False  # a call on a copy: drop the weights afterwards


def _devices(*layouts: Layout) -> frozenset[int]:
    return frozenset(d for layout in layouts for d in layout.mesh)


class _Builder:
    def __init__(self) -> None:
        self.units: list[Unit] = []
        self.last_on_device: dict[int, str] = {}
        self.of_role: dict[str, list[str]] = {}

    def add(self, unit: Unit, role_barrier: bool) -> None:
        """Append ``unit`` after its data sources, the last unit on each of its devices and,
        with ``role_barrier``, every earlier unit of its role."""
        after = set(unit.after)
        after.update(self.last_on_device[d] for d in unit.devices if d in self.last_on_device)
        if role_barrier:
            after.update(self.of_role.get(unit.role, []))
        unit = Unit(
            unit.name, unit.kind, unit.role, unit.groups, unit.devices, frozenset(after),
            unit.sources, unit.eta, unit.release,
        )  # fmt: skip
        self.units.append(unit)
        for d in unit.devices:
            self.last_on_device[d] = unit.name
        self.of_role.setdefault(unit.role, []).append(unit.name)


def plan_step(
    graph: Graph,
    layouts: Mapping[str, Layout],
    homes: Mapping[str, Layout],
    followers: Mapping[str, list[tuple[str, float]]],
    evaluate: bool = False,
) -> list[Unit]:
    """The units of one step in a valid order. ``layouts``: call -> its layout; ``homes``:
    role -> the layout holding its weights; ``followers``: role -> (role, eta) blended toward it
    after it trains (not when ``evaluate``)."""
    b = _Builder()
    for name in graph.order:
        call = graph.by_name[name]
        layout, home = layouts[name], homes[call.role]
        copy = layout != home
        if copy:
            keys = (group_key(call.role, home), group_key(call.role, layout))
            b.add(
                Unit(f"realloc:{name}", "realloc", call.role, keys, _devices(home, layout),
                     frozenset()),
                role_barrier=False,
            )  # fmt: skip
        sources = tuple(
            dict.fromkeys(graph.producers[k] for k in call.inputs if k in graph.producers)
        )
        sources = tuple(s for s in graph.order if s in sources)
        after = frozenset(sources) | ({f"realloc:{name}"} if copy else set())
        unit = Unit(
            name, "call", call.role, (group_key(call.role, layout),), _devices(layout), after,
            sources, release=copy,
        )  # fmt: skip
        trains = call.kind == "train" and not evaluate
        b.add(unit, role_barrier=trains)
        if not trains:
            continue
        for follower, eta in followers.get(call.role, []):
            keys = (group_key(call.role, home), group_key(follower, homes[follower]))
            devices = _devices(home, homes[follower])
            b.add(
                Unit(f"ema:{follower}", "realloc", follower, keys, devices, frozenset({name}),
                     eta=eta),
                role_barrier=True,
            )  # fmt: skip
    return b.units


def waves(units: list[Unit]) -> list[list[str]]:
    """Units grouped by how many units must finish before each can start (its depth): units of
    one wave may run at the same time."""
    depth: dict[str, int] = {}
    for u in units:
        depth[u.name] = 1 + max((depth[a] for a in u.after), default=-1)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for u in units:
        out[depth[u.name]].append(u.name)
    return out
