"""Simulator: schedule a few unrolled iterations of a graph under a plan and measure it.

    for each iteration, each call in graph order:
      ready   = its producers in this iteration finished, and its role's train call of the
                previous iteration finished (on-policy)
      realloc = if the call runs away from its role's home layout, the weights move first,
                occupying the home mesh and the call's mesh
      start   = ready, once every device of its mesh is free (overlapping meshes serialize,
                disjoint ones overlap)

It returns the steady iteration time (how far apart the last iterations finish: a long run
overlaps an iteration's first calls with the previous one's last), every span, and the peak memory
per device: what every role keeps on its home devices, plus the largest transient of any call
(or reallocated copy) on that device. A plan whose peak exceeds a device's memory is infeasible.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from rayhf.graph import Graph
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import AnalyticCost, Workload, max_shard_params
from rayhf.planner.plan import Plan


@dataclass(frozen=True)
class SimSpan:
    name: str  # a call, or "realloc:<call>"
    iteration: int
    start: float
    end: float
    devices: tuple[int, ...]


@dataclass
class Simulation:
    iteration_seconds: float
    spans: list[SimSpan] = field(default_factory=list)
    peak_memory: dict[int, float] = field(default_factory=dict)  # device -> bytes
    over_memory: list[tuple[str, int, float]] = field(default_factory=list)  # (what, device, B)
    refused: list[str] = field(default_factory=list)  # calls whose engine cannot take the layout

    @property
    def feasible(self) -> bool:
        return not self.over_memory and not self.refused


@functools.lru_cache(maxsize=16384)
def realloc_seconds(cost: AnalyticCost, spec: ModelSpec, src: Layout, dst: Layout) -> float:
    """Moving ``spec`` from ``src`` to ``dst``: every destination device receives its shard,
    the senders share the work (``rayhf.realloc.plan``'s spreading)."""
    b = cost.cluster.device.dtype_bytes
    shard = max_shard_params(spec, dst.tp, dst.pp) * b
    total = shard * dst.world_size
    senders = max(1, len(set(src.mesh)))
    bandwidth = cost.cluster.bandwidth(tuple(sorted(set(src.mesh) | set(dst.mesh))))
    return max(shard, total / senders) / bandwidth + cost.cluster.link_latency


def simulate(
    graph: Graph,
    plan: Plan,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cost: AnalyticCost,
    n_iterations: int = 3,
    moved: Callable[[str, Layout, Layout], float] | None = None,
    concurrent: bool = True,
) -> Simulation:
    """Schedule ``n_iterations`` of ``graph``; ``works`` gives each call's workload. With
    ``concurrent=False`` every call waits for every device (a driver that runs one call at a
    time; rayhf's runs calls on disjoint meshes at once)."""
    homes = plan.home_layouts(graph)
    trained = {c.role for c in graph.calls if c.kind == "train"}
    steps = _price_steps(graph, plan, specs, works, cost, moved)
    producers = {name: _producers(graph, name) for name in graph.order}
    n_devices = _n_devices(plan, cost)
    free = np.zeros(n_devices)  # device -> when it is next free
    last_train: dict[str, float] = {}
    spans: list[SimSpan] = []
    for it in range(n_iterations):
        done: dict[str, float] = {}
        train_end: dict[str, float] = {}
        for name in graph.order:
            call = graph.by_name[name]
            ready = max([0.0, last_train.get(call.role, 0.0), *(done[p] for p in producers[name])])
            for what, devices, index, seconds in steps[name]:
                where = index if concurrent else slice(None)
                start = max(ready, float(free[where].max()))
                ready = start + seconds
                spans.append(SimSpan(what, it, start, ready, devices))
                free[where] = ready
            done[name] = ready
            if call.kind == "train":
                train_end[call.role] = ready
        last_train.update(train_end)
    sim = Simulation(_period(spans, n_iterations), spans)
    sim.refused = _refused(graph, plan, works)
    _memory(sim, graph, plan, specs, works, cost, homes, trained)
    return sim


_Step = tuple[str, tuple[int, ...], "np.ndarray | slice", float]


def _price_steps(
    graph: Graph,
    plan: Plan,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cost: AnalyticCost,
    moved: Callable[[str, Layout, Layout], float] | None,
) -> dict[str, list[_Step]]:
    """Every iteration runs the same steps: price each once. Per call, its steps as (span
    name, devices, their index into the free-time array, seconds): a reallocation before it if
    it runs away from its role's home, then the call."""
    homes = plan.home_layouts(graph)
    overhead = getattr(cost, "call_overhead", 0.0)  # the driver's cost of a call (profiled)

    def move(role: str, src: Layout, dst: Layout) -> float:
        if moved is not None:
            return moved(role, src, dst)
        return realloc_seconds(cost, specs[role], src, dst)

    steps: dict[str, list[_Step]] = {}
    for name in graph.order:
        call, layout = graph.by_name[name], plan.layouts[name]
        home = homes[call.role]
        own: list[_Step] = []
        if call.role in specs and layout != home:
            devices = _union(home.mesh, layout.mesh)
            seconds = move(call.role, home, layout) + overhead
            own.append((f"realloc:{name}", devices, _index(devices), seconds))
        if call.role in specs:
            seconds = cost.call(specs[call.role], layout, works[name]).seconds
        else:  # a function-valued role (a reward function) costs ~nothing
            seconds = overhead
        own.append((name, layout.mesh, _index(layout.mesh), seconds))
        steps[name] = own
    return steps


def _refused(graph: Graph, plan: Plan, works: dict[str, Workload]) -> list[str]:
    """Calls whose engine cannot run them where the plan puts them: vLLM and DeepSpeed hold
    whole models per rank (dp-only layouts); a ZeRO-3 group holds slices, so the role's other
    calls need layouts of their own."""
    lay = plan.layouts
    zero3 = {c.role: lay[c.name] for c in graph.calls if works[c.name].zero_stage == 3}
    return [
        name
        for name in graph.order
        if (works[name].whole_model_ranks and lay[name].tp * lay[name].pp > 1)
        or (works[name].kind != "train" and zero3.get(graph.by_name[name].role) == lay[name])
    ]


def _period(spans: list[SimSpan], n_iterations: int) -> float:
    """Seconds per iteration in steady state: how far apart the iterations finish (the first
    one has nothing to overlap with, so a run of many iterations pays its fill only once)."""
    ends = [0.0] * n_iterations
    for s in spans:
        ends[s.iteration] = max(ends[s.iteration], s.end)
    if n_iterations == 1:
        return ends[0]
    return (ends[-1] - ends[0]) / (n_iterations - 1)


def _n_devices(plan: Plan, cost: AnalyticCost) -> int:
    return max(cost.cluster.n_devices, 1 + max(max(lay.mesh) for lay in plan.layouts.values()))


@functools.lru_cache(maxsize=8192)
def _index(mesh: tuple[int, ...]) -> np.ndarray | slice:
    """Index of ``mesh``'s devices in a per-device array (a slice when they are contiguous)."""
    if mesh == tuple(range(mesh[0], mesh[0] + len(mesh))):
        return slice(mesh[0], mesh[0] + len(mesh))
    return np.array(mesh)


@functools.lru_cache(maxsize=8192)
def _union(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(set(a) | set(b)))


def _producers(graph: Graph, name: str) -> list[str]:
    producers = graph.producers
    return [producers[k] for k in graph.by_name[name].inputs if k in producers]


def _memory(
    sim: Simulation,
    graph: Graph,
    plan: Plan,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cost: AnalyticCost,
    homes: dict[str, Layout],
    trained: set[str],
) -> None:
    """Resident weights per device, plus the largest call transient on it."""
    n_devices = _n_devices(plan, cost)
    resident = np.zeros(n_devices)
    used = np.zeros(n_devices, dtype=bool)
    trains = {c.role: works[c.name] for c in graph.calls if c.kind == "train"}
    for role, home in homes.items():
        if role in specs:
            kept = cost.resident(specs[role], home, role in trained, trains.get(role))
            resident[_index(home.mesh)] += kept
            used[_index(home.mesh)] = True
    for name in graph.order:  # an engine's own memory (vLLM) stays for the whole run
        role, index = graph.by_name[name].role, _index(plan.layouts[name].mesh)
        if role in specs:
            resident[index] += cost.engine_resident(specs[role], works[name])
    transient = np.zeros(n_devices)
    owner = np.full(n_devices, -1)  # index in graph.order of the call with that transient
    for i, name in enumerate(graph.order):
        role, layout = graph.by_name[name].role, plan.layouts[name]
        if role not in specs:
            continue
        work = works[name]
        need = cost.call(specs[role], layout, work).memory  # memoized
        need -= cost.engine_resident(specs[role], work)  # counted as resident above
        if layout == homes[role]:  # the weights it counts are already resident, nothing more:
            # an inference or generation of a trained role still needs its cache and logits
            kind_train = work.kind == "train"
            need -= cost.resident(specs[role], layout, kind_train, work if kind_train else None)
        index = _index(layout.mesh)
        used[index] = True
        bigger = transient[index] < need
        transient[index] = np.where(bigger, need, transient[index])
        owner[index] = np.where(bigger, i, owner[index])
    peak = resident + transient
    devices = np.flatnonzero(used)
    sim.peak_memory = dict(zip(devices.tolist(), peak[devices].tolist(), strict=True))
    capacity = cost.cluster.device.memory_bytes
    for d in np.flatnonzero(used & (peak > capacity)).tolist():
        what = graph.order[owner[d]] if owner[d] >= 0 else "weights"
        sim.over_memory.append((what, d, float(peak[d])))
