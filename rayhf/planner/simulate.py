"""Simulator: schedule a few unrolled iterations of a graph under a plan and measure it.

    for each iteration, each call in graph order:
      ready   = its producers in this iteration finished, and its role's train call of the
                previous iteration finished (on-policy)
      realloc = if the call runs away from its role's home layout, the weights move first,
                occupying the home mesh and the call's mesh
      start   = ready, once every device of its mesh is free (overlapping meshes serialize,
                disjoint ones overlap)

It returns the steady iteration time (makespan / iterations), every span, and the peak memory
per device: what every role keeps on its home devices, plus the largest transient of any call
(or reallocated copy) on that device. A plan whose peak exceeds a device's memory is infeasible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from rayhf.graph import Graph
from rayhf.models.spec import ModelSpec
from rayhf.planner.cost import AnalyticCost, Workload, max_shard_params
from rayhf.planner.layout import Layout
from rayhf.planner.plan import Plan


@dataclass(frozen=True)
class Span:
    name: str  # a call, or "realloc:<call>"
    iteration: int
    start: float
    end: float
    devices: tuple[int, ...]


@dataclass
class Simulation:
    iteration_seconds: float
    spans: list[Span] = field(default_factory=list)
    peak_memory: dict[int, float] = field(default_factory=dict)  # device -> bytes
    over_memory: list[tuple[str, int, float]] = field(default_factory=list)  # (what, device, B)

    @property
    def feasible(self) -> bool:
        return not self.over_memory


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
    n_iterations: int = 2,
    moved: Callable[[str, Layout, Layout], float] | None = None,
) -> Simulation:
    """Schedule ``n_iterations`` of ``graph``; ``works`` gives each call's workload."""
    homes = plan.home_layouts(graph)
    trained = {c.role for c in graph.calls if c.kind == "train"}

    def move(role: str, src: Layout, dst: Layout) -> float:
        if moved is not None:
            return moved(role, src, dst)
        return realloc_seconds(cost, specs[role], src, dst)

    free: dict[int, float] = {}
    last_train: dict[str, float] = {}
    spans: list[Span] = []
    for it in range(n_iterations):
        done: dict[str, float] = {}
        train_end: dict[str, float] = {}
        for name in graph.order:
            call, layout = graph.by_name[name], plan.layouts[name]
            deps = [done[p] for p in _producers(graph, name)]
            ready = max([0.0, last_train.get(call.role, 0.0), *deps])
            home = homes[call.role]
            if call.role in specs and layout != home:
                devices = tuple(sorted(set(home.mesh) | set(layout.mesh)))
                start = max([ready, *(free.get(d, 0.0) for d in devices)])
                end = start + move(call.role, home, layout)
                spans.append(Span(f"realloc:{name}", it, start, end, devices))
                for d in devices:
                    free[d] = end
                ready = end
            start = max([ready, *(free.get(d, 0.0) for d in layout.mesh)])
            end = start
            if call.role in specs:  # a function-valued role (a reward function) costs ~nothing
                end += cost.call(specs[call.role], layout, works[name]).seconds
            spans.append(Span(name, it, start, end, layout.mesh))
            for d in layout.mesh:
                free[d] = end
            done[name] = end
            if call.kind == "train":
                train_end[call.role] = end
        last_train.update(train_end)
    makespan = max((s.end for s in spans), default=0.0)
    sim = Simulation(makespan / n_iterations, spans)
    _memory(sim, graph, plan, specs, works, cost, homes, trained)
    return sim


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
    resident: dict[int, float] = {}
    for role, home in homes.items():
        if role in specs:
            held = cost.resident(specs[role], home, role in trained)
            for d in home.mesh:
                resident[d] = resident.get(d, 0.0) + held
    transient: dict[int, tuple[float, str]] = {}
    for name in graph.order:
        role, layout = graph.by_name[name].role, plan.layouts[name]
        if role not in specs:
            continue
        need = cost.memory(specs[role], layout, works[name])
        if layout == homes[role]:
            need -= cost.resident(specs[role], layout, role in trained)  # already resident
        for d in layout.mesh:
            if need > transient.get(d, (0.0, ""))[0]:
                transient[d] = (need, name)
    capacity = cost.cluster.device.memory_bytes
    for d in sorted(set(resident) | set(transient)):
        extra, what = transient.get(d, (0.0, "weights"))
        sim.peak_memory[d] = resident.get(d, 0.0) + extra
        if sim.peak_memory[d] > capacity:
            sim.over_memory.append((what, d, sim.peak_memory[d]))
