"""Simulator: price the step the driver runs (``rayhf.planner.step``) over a few iterations.

    units of one step (calls, weight moves, EMA blends, with their order) -> seconds of each
    per iteration (a period of ``step.pipeline``: with ``max_staleness: k``, the policy's
    generation of step i + k, then the rest of step i), each unit in order:
      start = when its ``after`` units of this iteration end, and
              with ``overlap``: its units of earlier iterations (the driver submits step i+1
                while step i runs: ``carried``, or the pipeline's cross-period order);
              without: every unit of the previous iteration (one step at a time)

On emulated devices that share fewer cores than there are devices (``ClusterSpec.host_cores``),
units that run together share the cores: each device process gets an equal share, at most one,
but for the seconds it waits on the links (``CallCost.waits``), which take as long as ever.

It returns the steady iteration time (how far apart the last iterations finish), every span,
and the peak memory per device: what every role keeps on its home devices, plus the largest
transient of any call (or reallocated copy) on that device. A plan whose peak exceeds a device's
memory is infeasible.

A train call runs at the ZeRO stage the plan gives it; where the plan is silent and the workload
leaves a choice (``Workload.zero_choices``), at the fastest stage that fits, raised stage by stage
while its devices overflow (``staged``): the same rule for the search and every baseline. So is
the rule for a LoRA role's copies: each keeps its frozen weights, its moves carrying the adapters
alone, unless its devices overflow; then the plan releases it (``released``) and its moves carry
the whole model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from rayhf.graph import Graph
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.step import Slot, Unit, leading, pipeline, plan_step
from rayhf.realloc.plan import SHM_MIN_BYTES, move_load


@dataclass(frozen=True)
class SimSpan:
    name: str  # a unit: a call, "realloc:<call>" or "ema:<role>"
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
    stages: dict[str, int] = field(default_factory=dict)  # train call -> ZeRO stage, where chosen
    released: frozenset[str] = frozenset()  # calls whose LoRA copy is released (``Plan``)

    @property
    def feasible(self) -> bool:
        return not self.over_memory and not self.refused


@dataclass(frozen=True)
class _Timeline:
    """How the simulated iterations run: how many, whether step i+1 starts while step i runs
    (``overlap``), and whether units on disjoint devices run together (``concurrent``)."""

    n_iterations: int
    overlap: bool
    concurrent: bool = True


@dataclass(frozen=True)
class Carried:
    """What a weight move reads and carries: from a ZeRO-3 source's flat slices (``flat``);
    all but a LoRA role's frozen base weights, which its copies keep (``skip_frozen``)."""

    flat: bool = False
    skip_frozen: bool = False


@functools.lru_cache(maxsize=16384)
def realloc_seconds(
    cost: AnalyticCost, spec: ModelSpec, src: Layout, dst: Layout, carried: Carried = Carried()
) -> float:
    """Moving ``spec`` from ``src`` to ``dst`` as ``rayhf.realloc.plan`` routes it (``carried``:
    from a ZeRO-3 source, or the adapters alone), in the destination's weight dtype
    (``rayhf.realloc.mover``: a bf16 copy receives bf16): the busiest device's bytes (what it
    sends or receives across devices, whichever is more, plus what it copies between its own
    processes) at the link bandwidth, the relays' pipeline fill (a stream's first message, up to
    4 MiB, per hop past the first) and a latency per hop. Within a node whose moves go through
    shared memory, a move of ``SHM_MIN_BYTES`` or more runs at that copy speed, and relays pass
    on only headers. GPUs shared by both groups stage the move through host memory at
    ``shared_gpu_bandwidth`` (one GPU with CUDA IPC: ``ipc_bandwidth``)."""
    itemsize = cost.weight_bytes(spec)
    load = move_load(spec, src, dst, itemsize, carried.flat, carried.skip_frozen)
    devices = tuple(sorted(set(src.mesh) | set(dst.mesh)))
    cluster = cost.cluster
    hops = max(1, load.depth) * cluster.link_latency
    if cluster.shared_gpu_bandwidth and set(src.mesh) & set(dst.mesh):
        one_gpu = len(devices) == 1 and cluster.ipc_bandwidth > 0
        rate = cluster.ipc_bandwidth if one_gpu else cluster.shared_gpu_bandwidth
        return load.busiest / rate + hops
    if cluster.shm_bandwidth and cluster.one_node(devices) and load.busiest >= SHM_MIN_BYTES:
        return load.busiest / cluster.shm_bandwidth + hops
    return (load.busiest + load.fill) / cluster.bandwidth(devices) + hops


def simulate(
    problem: Problem,
    plan: Plan,
    n_iterations: int = 3,
    moved: Callable[[str, Layout, Layout], float] | None = None,
) -> Simulation:
    """Run ``n_iterations`` of the problem's step under ``plan``: each call's workload, the EMA
    blends and whether step i+1 starts while step i runs as ``problem`` gives them. With
    ``problem.concurrent`` false every unit waits for the one before it (a driver that runs one
    unit at a time). ``moved``: a weight move's seconds, instead of the cost model's."""
    graph = problem.graph
    homes = plan.home_layouts(graph)
    plan = released(problem, plan)
    works, stages = staged(problem, plan)
    problem = problem.with_works(works)
    step = problem.step.with_lora(problem.specs, plan.released)
    units = plan_step(graph, plan.layouts, homes, step)
    slots = pipeline(units, leading(graph, units, step.staleness), step.staleness)
    overlap = step.overlap or step.staleness > 0
    if step.staleness:  # the pipeline fills for k periods: price the ones after
        n_iterations = max(n_iterations, 2 * step.staleness + 3)
    flat = {c.role for c in graph.calls if c.kind == "train" and works[c.name].zero_stage == 3}
    seconds, waits = _price(problem, units, moved, {r: homes[r] for r in flat})
    cores = problem.cluster.host_cores
    run = _Timeline(n_iterations, overlap, problem.concurrent)
    if problem.concurrent and 0 < cores < _n_devices(plan, problem.cost):
        procs = {u.name: len(u.devices) if u.role in problem.specs else 0 for u in units}
        spans = _shared_cores(slots, Work(seconds, waits, procs), cores, run)
    else:
        spans = _one_by_one(slots, seconds, run)
    period = _period(spans, n_iterations, step.staleness)
    sim = Simulation(period, spans, stages=stages, released=plan.released)
    sim.refused = _refused(graph, plan, works)
    sim.peak_memory, sim.over_memory = _memory(problem, plan)
    return sim


def _one_by_one(slots: list[Slot], seconds: dict[str, float], run: _Timeline) -> list[SimSpan]:
    """Each unit as soon as what it runs after has ended, at full speed (every device its own)."""
    n_iterations, overlap, concurrent = run.n_iterations, run.overlap, run.concurrent
    spans: list[SimSpan] = []
    end: list[dict[str, float]] = []
    for it in range(n_iterations):
        end.append({})
        last = max(end[it - 1].values(), default=0.0) if it else 0.0
        for slot in slots:
            u = slot.unit
            waits = [
                end[it - lag][a] for lag, a in slot.after if it >= lag and (overlap or lag == 0)
            ]
            if not overlap:
                waits.append(last)
            if not concurrent:  # one unit at a time: after the one before it
                waits.append(spans[-1].end if spans else 0.0)
            start = max(waits, default=0.0)
            end[it][u.name] = start + seconds[u.name]
            spans.append(SimSpan(u.name, it, start, end[it][u.name], tuple(sorted(u.devices))))
    return spans


@dataclass(frozen=True)
class Work:
    """Each unit's seconds, those of them its processes wait on the links, and its device
    processes (none for a function the driver runs)."""

    seconds: dict[str, float]
    waits: dict[str, float]
    procs: dict[str, int]

    def rate(self, name: str, share: float) -> float:
        """How fast ``name`` runs while its processes get ``share`` of a core each: its
        waits take as long as ever, the rest ``1 / share`` times as long."""
        total, wait = self.seconds[name], self.waits.get(name, 0.0)
        if share >= 1.0 or total <= wait:
            return 1.0
        return total / ((total - wait) / share + wait)


def _shared_cores(slots: list[Slot], work: Work, cores: float, run: _Timeline) -> list[SimSpan]:
    """As ``_one_by_one``, on emulated devices that share ``cores`` cores: while units run
    together, each of their device processes gets an equal share of the cores, at most one
    (processor sharing), for all but the seconds it waits on the links."""
    seconds, procs = work.seconds, work.procs
    n_iterations, overlap = run.n_iterations, run.overlap
    deps: dict[tuple[int, str], list[tuple[int, str]]] = {}
    for it in range(n_iterations):
        for slot in slots:
            mine = [(it - lag, a) for lag, a in slot.after if it >= lag and (overlap or not lag)]
            if it and not overlap:
                mine += [(it - 1, s.unit.name) for s in slots]
            deps[it, slot.unit.name] = mine
    by_name = {s.unit.name: s.unit for s in slots}
    left = {key: seconds[key[1]] for key in deps}
    start: dict[tuple[int, str], float] = {}
    end: dict[tuple[int, str], float] = {}
    waiting, now = list(deps), 0.0
    running: list[tuple[int, str]] = []
    while waiting or running:
        ready = [k for k in waiting if all(d in end for d in deps[k])]
        for k in ready:
            waiting.remove(k)
            start[k] = now
            running.append(k)
        busy = sum(procs[k[1]] for k in running)
        share = min(1.0, cores / busy) if busy else 1.0
        rate = {k: work.rate(k[1], share) for k in running}
        step = min(left[k] / rate[k] for k in running)
        now += step
        for k in list(running):
            left[k] -= step * rate[k]
            if left[k] <= 1e-12:
                running.remove(k)
                end[k] = now
    return [
        SimSpan(name, it, start[it, name], end[it, name], tuple(sorted(by_name[name].devices)))
        for it, name in deps
    ]


def staged(problem: Problem, plan: Plan) -> tuple[dict[str, Workload], dict[str, int]]:
    """Every call's workload with its train calls' ZeRO stages, and those stages (where the plan
    or the rule set them): the plan's stage, else among the workload's ``zero_choices`` that
    the layout allows (2-3: dp only; 3: not while another call of the role shares the layout)
    the fastest that fits a device on its own, raised while the plan overflows its devices."""
    graph, specs, works, cost = problem.graph, problem.specs, problem.works, problem.cost
    out, choices = dict(works), {}
    for c in graph.calls:
        if c.kind != "train" or c.role not in specs:
            continue
        if c.name in plan.zero:
            out[c.name] = works[c.name].with_stage(plan.zero[c.name])
        elif works[c.name].zero_choices:
            allowed = _allowed(graph, plan, c.name, works[c.name])
            if allowed:
                choices[c.name] = allowed
                out[c.name] = _fastest_fitting(cost, specs[c.role], plan.layouts[c.name],
                                               works[c.name], allowed)  # fmt: skip
    for _ in range(3 if choices else 0):  # a stage up where a train call's devices overflow
        _, over = _memory(problem.with_works(out), plan)
        full = {d for _, d, _ in over}
        raised = False
        for name, allowed in choices.items():
            now = out[name].zero_stage
            if full & set(plan.layouts[name].mesh) and now < allowed[-1]:
                out[name] = works[name].with_stage(min(s for s in allowed if s > now))
                raised = True
        if not raised:
            break
    named = set(plan.zero) | set(choices)
    return out, {n: out[n].zero_stage for n in graph.order if n in named}


def _allowed(graph: Graph, plan: Plan, name: str, work: Workload) -> tuple[int, ...]:
    lay = plan.layouts[name]
    shared = any(
        plan.layouts[n] == lay for n in graph.role_calls(graph.by_name[name].role) if n != name
    )
    return tuple(s for s in work.choices_on(lay) if not (s == 3 and shared))


def _fastest_fitting(
    cost: AnalyticCost, spec: ModelSpec, layout: Layout, work: Workload, allowed: tuple[int, ...]
) -> Workload:
    """``work`` at the fastest of the ``allowed`` stages whose call fits a device by itself,
    else at the highest. Ties go to the lower stage: at dp 1 every stage prices and keeps the
    same, and stages 2-3 run on DeepSpeed, whose per-step cost the price leaves out; where a
    higher stage's smaller shards are needed, ``staged`` raises it while the plan overflows."""
    cap = cost.cluster.device.memory_bytes
    priced = [(cost.call(spec, layout, work.with_stage(s)), s) for s in allowed]
    fits = [(c.seconds, s) for c, s in priced if c.memory <= cap]
    return work.with_stage(min(fits)[1] if fits else allowed[-1])


def _price(
    problem: Problem,
    units: list[Unit],
    moved: Callable[[str, Layout, Layout], float] | None,
    flat: dict[str, Layout],
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of each unit: a call's cost on its layout (a function-valued role, such as a
    reward function, costs only the driver's overhead), a move's transfer (from a ZeRO-3
    group's slices where ``flat`` names the role's home), each plus the driver's cost of a
    unit; and of each call, the seconds it waits on the links."""
    specs, works, cost = problem.specs, problem.works, problem.cost
    overhead = getattr(cost, "call_overhead", 0.0)  # the driver's cost of a call (profiled)
    out: dict[str, float] = {}
    waits: dict[str, float] = {}
    for u in units:
        if u.kind == "realloc":
            src, dst = u.layouts
            if moved is not None:
                out[u.name] = moved(u.role, src, dst) + overhead
            else:
                carried = Carried(flat.get(u.reads or u.role) == src, u.skip_frozen)
                seconds = realloc_seconds(cost, specs[u.role], src, dst, carried)
                out[u.name] = seconds + overhead
        elif u.role in specs:
            priced = cost.call(specs[u.role], u.layouts[0], works[u.name])
            out[u.name], waits[u.name] = priced.seconds, priced.waits
        else:
            out[u.name] = overhead
    return out, waits


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


def _period(spans: list[SimSpan], n_iterations: int, settle: int = 0) -> float:
    """Seconds per iteration in steady state: how far apart the iterations finish (the first
    one has nothing to overlap with, so a run of many iterations pays its fill only once);
    ``settle``: iterations left out at the start (a pipeline k deep fills for k)."""
    ends = [0.0] * n_iterations
    for s in spans:
        ends[s.iteration] = max(ends[s.iteration], s.end)
    if n_iterations == 1:
        return ends[0]
    first = min(settle, n_iterations - 2)
    return (ends[-1] - ends[first]) / (n_iterations - 1 - first)


def _n_devices(plan: Plan, cost: AnalyticCost) -> int:
    return max(cost.cluster.n_devices, 1 + max(max(lay.mesh) for lay in plan.layouts.values()))


@functools.lru_cache(maxsize=8192)
def _index(mesh: tuple[int, ...]) -> np.ndarray | slice:
    """Index of ``mesh``'s devices in a per-device array (a slice when they are contiguous)."""
    if mesh == tuple(range(mesh[0], mesh[0] + len(mesh))):
        return slice(mesh[0], mesh[0] + len(mesh))
    return np.array(mesh)


def _memory(problem: Problem, plan: Plan) -> tuple[dict[int, float], list[tuple[str, int, float]]]:
    """Peak bytes per used device (resident weights plus the largest call transient on it),
    and (what, device, bytes) for each device over its memory."""
    graph, specs, works, cost = problem.graph, problem.specs, problem.works, problem.cost
    homes, trained = plan.home_layouts(graph), problem.trained
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
    copies = _kept_copies(problem, plan)
    for (_, layout), weights in copies.items():  # a LoRA role's copies keep their weights
        resident[_index(layout.mesh)] += weights
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
        need -= copies.get((role, layout), 0.0)
        index = _index(layout.mesh)
        used[index] = True
        bigger = transient[index] < need
        transient[index] = np.where(bigger, need, transient[index])
        owner[index] = np.where(bigger, i, owner[index])
    peak = resident + transient
    devices = np.flatnonzero(used)
    capacity = cost.cluster.device.memory_bytes
    over = [
        (graph.order[owner[d]] if owner[d] >= 0 else "weights", d, float(peak[d]))
        for d in np.flatnonzero(used & (peak > capacity)).tolist()
    ]
    return dict(zip(devices.tolist(), peak[devices].tolist(), strict=True)), over


def _kept_copies(problem: Problem, plan: Plan) -> dict[tuple[str, Layout], float]:
    """Bytes per device that each copy of a LoRA role keeps between calls, but those the plan
    releases: its weights (the frozen ones never change, so it holds them from the start;
    moves bring the adapters)."""
    graph, homes, out = problem.graph, plan.home_layouts(problem.graph), {}
    dropped = {(graph.by_name[c].role, plan.layouts[c]) for c in plan.released}
    for c in graph.calls:
        copy = (c.role, plan.layouts[c.name])
        if c.role in problem.adapters and copy[1] != homes[c.role] and copy not in dropped:
            out[copy] = problem.cost.resident(problem.specs[c.role], copy[1], False)
    return out


def released(problem: Problem, plan: Plan) -> Plan:
    """``plan`` with the copies of LoRA roles on devices it overflows released (each drops its
    weights after its call, and the move before the call carries the whole model); the others
    keep their frozen weights. The same rule for the search and every baseline."""
    copies = _kept_copies(problem, plan)
    if not copies:
        return plan
    full = {d for _, d, _ in _memory(problem, plan)[1]}
    drop = frozenset(
        c.name
        for c in problem.graph.calls
        if (c.role, plan.layouts[c.name]) in copies and full & set(plan.layouts[c.name].mesh)
    )
    return replace(plan, released=plan.released | drop) if drop else plan
