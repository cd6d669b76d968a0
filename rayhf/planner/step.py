"""One step of the graph as units of work and the order between them: the one definition the
driver runs and the simulator prices (pure: no Ray).

    graph calls in topological order
      -> units: each call on its role group; a weight move "realloc:<call>" before a call whose
         layout is not its role's home layout; a blend "ema:<role>" after a train call into each
         role that follows it by moving average
      -> each unit runs after: the calls whose keys it reads, the previous unit on every device
         it uses (calls sharing devices run in graph order), and, for a train call or a blend,
         every earlier unit of its role (a role trains on the weights its step used: on-policy)

Units on disjoint devices with no path between them run at the same time. Between steps
(``carried``): a unit of step i+1 runs after step i's last unit on each of its devices and after
step i's last update of its role (a train call or a blend); a role nobody updates is no barrier.
The dataset rows are the only other input, and they are ready before the step is submitted.

With ``max_staleness: k >= 1`` (``pipeline``) the steps repeat as periods: period p runs the
leading units (the policy's generate calls and their weight moves, and the frozen roles' calls
that share their devices: ``leading``) of step p + k first, then the rest of step p. So on a
device the generation of step p + k comes before the training of step p, and it waits only for
the policy's update of step p - 1: it samples with weights at most k updates old, while step p
trains on other devices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from rayhf.errors import RayhfError
from rayhf.graph import Graph
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout


def group_key(role: str, layout: Layout) -> str:
    """The role group that holds ``role`` in ``layout`` (names its actors and transfer groups)."""
    return f"{role}.{layout.name}"


@dataclass(frozen=True)
class StepOptions:
    """What besides the graph and the plan shapes a step: the EMA blends and whether steps
    overlap (``driver.overlap_steps`` on the plain executor)."""

    followers: Mapping[str, list[tuple[str, float]]] = field(default_factory=dict)  # role ->
    # (role, eta) blended toward it after it trains
    overlap: bool = True
    staleness: int = 0  # algorithm.max_staleness: how many steps ahead the generation may run
    # roles trained through LoRA adapters: their copies keep the frozen base weights from the
    # start, so a move to one carries only what trains; but those of the calls ``released``
    # names (``Plan.released``), which drop their weights after the call as other copies do
    adapters: frozenset[str] = frozenset()
    released: frozenset[str] = frozenset()

    def with_lora(self, specs: Mapping[str, ModelSpec], released: frozenset[str]) -> StepOptions:
        """These options with the LoRA roles of ``specs`` and the calls whose copies a plan
        releases (``Plan.released``): the step a run of that plan takes."""
        return replace(self, adapters=lora_roles(specs), released=released)


def lora_roles(specs: Mapping[str, ModelSpec]) -> frozenset[str]:
    """The roles of ``specs`` trained through LoRA adapters."""
    return frozenset(role for role, spec in specs.items() if spec.lora is not None)


@dataclass(frozen=True)
class Unit:
    """A call on its role group, or a weight move between two role groups."""

    name: str  # the call, "realloc:<call>" or "ema:<role>"
    kind: Literal["call", "realloc"]
    role: str  # the role whose weights it uses (a move: the role that receives them)
    groups: tuple[str, ...]  # group keys taking part: (the call's group,) or (source, destination)
    layouts: tuple[Layout, ...]  # the groups' layouts, in the same order
    after: frozenset[str]  # units that must finish first
    sources: tuple[str, ...] = ()  # a call: the calls whose outputs it reads, in graph order
    eta: float | None = None  # a blend: dst = eta * src + (1 - eta) * dst
    release: bool = False  # a call on a copy: drop the weights afterwards
    skip_frozen: bool = False  # a move: only what trains (the copy keeps a LoRA base's weights)
    updates: bool = False  # it changes its role's weights (a train call, a blend)
    reads: str = ""  # a blend: the role whose weights it reads (else its own role)

    @property
    def devices(self) -> frozenset[int]:
        return frozenset(d for layout in self.layouts for d in layout.mesh)


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
        unit = replace(unit, after=frozenset(after))
        self.units.append(unit)
        for d in unit.devices:
            self.last_on_device[d] = unit.name
        self.of_role.setdefault(unit.role, []).append(unit.name)


def plan_step(
    graph: Graph,
    layouts: Mapping[str, Layout],
    homes: Mapping[str, Layout],
    step: StepOptions,
    evaluate: bool = False,
) -> list[Unit]:
    """The units of one step in a valid order. ``layouts``: call -> its layout; ``homes``:
    role -> the layout holding its weights; ``step``: the roles blended toward a role after it
    trains (not when ``evaluate``), and those trained through adapters (a copy of one keeps its
    frozen weights: moves to it carry the adapters, and it is never released; unless one of its
    calls is among ``step.released``)."""
    released = {group_key(graph.by_name[c].role, layouts[c]) for c in step.released}
    b = _Builder()
    for name in graph.order:
        call = graph.by_name[name]
        layout, home = layouts[name], homes[call.role]
        copy = layout != home
        key = group_key(call.role, layout)
        adapters = call.role in step.adapters and key not in released
        if copy:
            keys = (group_key(call.role, home), key)
            move = Unit(
                f"realloc:{name}", "realloc", call.role, keys, (home, layout), frozenset(),
                skip_frozen=adapters,
            )  # fmt: skip
            b.add(move, role_barrier=False)
        sources = {graph.producers[k] for k in call.inputs if k in graph.producers}
        ordered = tuple(s for s in graph.order if s in sources)
        after = frozenset(ordered) | ({f"realloc:{name}"} if copy else set())
        trains = call.kind == "train" and not evaluate
        unit = Unit(
            name, "call", call.role, (key,), (layout,), after, ordered,
            release=copy and not adapters, updates=trains,
        )  # fmt: skip
        b.add(unit, role_barrier=trains)
        if not trains:
            continue
        for follower, eta in step.followers.get(call.role, []):
            keys = (group_key(call.role, home), group_key(follower, homes[follower]))
            blend = Unit(
                f"ema:{follower}", "realloc", follower, keys, (home, homes[follower]),
                frozenset({name}), eta=eta, updates=True, reads=call.role,
            )  # fmt: skip
            b.add(blend, role_barrier=True)
    return b.units


def _last_units(units: list[Unit]) -> tuple[dict[int, str], dict[str, str]]:
    """Of ``units`` in their order: the last on each device, and each role's last update."""
    on_device: dict[int, str] = {}
    update: dict[str, str] = {}
    for u in units:
        on_device.update(dict.fromkeys(u.devices, u.name))
        if u.updates:
            update[u.role] = u.name
    return on_device, update


def carried(units: list[Unit]) -> dict[str, frozenset[str]]:
    """Per unit of step i+1, the units of step i it runs after (``units``: one step): step i's
    last unit on each device it is the first of step i+1 to use, and step i's last update of
    its role. The rest of step i may still run."""
    last_on_device, last_update = _last_units(units)
    touched: set[int] = set()
    out: dict[str, frozenset[str]] = {}
    for u in units:
        before = {last_on_device[d] for d in u.devices - touched if d in last_on_device}
        for role in {u.role, u.reads or u.role}:
            if role in last_update:
                before.add(last_update[role])
        out[u.name] = frozenset(before)
        touched |= u.devices
    return out


@dataclass(frozen=True)
class Slot:
    """A unit in the repeating period of the pipeline: period p runs it for step p + ``lead``."""

    unit: Unit
    lead: int  # steps ahead of its period: the staleness for a leading unit, else 0
    after: frozenset[tuple[int, str]]  # (periods back, unit) it runs after; 0 = this period

    def offset(self, lag: int, other: Slot) -> int:
        """How many steps after this slot's step is ``other``'s, in the period ``lag`` back."""
        return other.lead - self.lead - lag


def leading(graph: Graph, units: list[Unit], staleness: int) -> frozenset[str]:
    """The units that run ``staleness`` steps ahead: each generate call of a role the graph
    trains, with the weight move before it, and the units of roles nobody updates (a reference,
    a reward model) that read only leading units and run on the generate calls' devices only.
    None when ``staleness`` is 0. A generate call must depend on nothing else of its step (it
    starts before the rest of the step has run).

    On a generation device a unit of step p + k comes before every unit of step p, so a frozen
    role's call there leads too: step p's training then reads its result from the period
    before instead of waiting behind the generation of step p + k. Its result does not depend
    on when it runs (its weights never change). Elsewhere it stays in step p: leading, it would
    make step p's training wait for step p + k's generation."""
    if not staleness:
        return frozenset()
    trained = {c.role for c in graph.calls if c.kind == "train"}
    lead = {
        u.name
        for u in units
        if (c := graph.by_name.get(u.name.removeprefix("realloc:"))) is not None
        and c.kind == "generate"
        and c.role in trained
    }
    if not lead:
        raise RayhfError(
            f"algorithm.max_staleness: {staleness}: graph '{graph.name}' generates nothing with a "
            "role it trains, so nothing can run ahead; set it to 0"
        )
    for u in units:
        if u.name in lead and (behind := sorted(u.after - lead)):
            raise RayhfError(
                f"algorithm.max_staleness: graph '{graph.name}' runs '{u.name}' after "
                f"'{behind[0]}' of its step, so it cannot run ahead; set max_staleness to 0"
            )
    generating = frozenset(
        d for u in units if u.name in lead and u.kind == "call" for d in u.devices
    )
    updated = {u.role for u in units if u.updates}
    for u in units:
        if u.role not in updated and u.after <= lead and u.devices <= generating:
            lead.add(u.name)
    return frozenset(lead)


def pipeline(units: list[Unit], lead: frozenset[str], staleness: int) -> list[Slot]:
    """The period of the pipelined steps, in the order the driver submits it: ``lead`` units
    (of step p + ``staleness``) first, then the others (of step p). Each slot runs after its
    units of the same step (``after``), the previous slot on each of its devices (this period or
    the last), and the previous period's last update of each role it uses. With no ``lead``
    this is the step itself with ``carried`` as the previous period's part."""
    if not lead:
        between = carried(units)
        return [
            Slot(u, 0, frozenset({(0, a) for a in u.after} | {(1, b) for b in between[u.name]}))
            for u in units
        ]
    order = [u for u in units if u.name in lead] + [u for u in units if u.name not in lead]
    ahead = {u.name: staleness if u.name in lead else 0 for u in units}
    previous_on_device, previous_update = _last_units(order)
    on_device: dict[int, str] = {}
    out: list[Slot] = []
    for u in order:
        deps = {(ahead[a] - ahead[u.name], a) for a in u.after}
        for d in sorted(u.devices):
            deps.add((0, on_device[d]) if d in on_device else (1, previous_on_device[d]))
        roles = {u.role, u.reads or u.role}
        deps.update((1, previous_update[r]) for r in roles if r in previous_update)
        on_device.update(dict.fromkeys(u.devices, u.name))
        out.append(Slot(u, ahead[u.name], frozenset(deps)))
    return out
