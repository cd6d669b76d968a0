"""Plan search: local improvement and simulated annealing over every call's layout, started
from the baselines.

Candidates for a call: a device mesh as ReaLHF defines them (an aligned block of 1, 2, 4, ...
devices inside a node, or any run of consecutive whole nodes) x every ``dp x tp x pp`` of its
size the model can take (tp a power of two within a node, pp any divisor) x micro-batches;
layouts whose call alone overflows a device are dropped. The energy of a plan is its simulated
iteration time; a plan that does not fit memory costs its time plus a penalty that grows with
the overflow, so annealing walks out of infeasible regions.

    each start (a tuned baseline) -> improve: every call on each of its shortlisted layouts,
        every role's home moved with its calls, pairs of calls side by side
    best -> anneal (random moves) -> improve its best again

Deterministic for a seed while the time limit does not cut a phase short; energies are
memoized, so revisited plans cost nothing.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, replace

from rayhf.graph import Graph
from rayhf.models.sharding import check_layout
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout, stage_major
from rayhf.planner.cost import Workload
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.simulate import Simulation, simulate

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def blocks(n_devices: int, per_node: int | None = None) -> list[tuple[int, ...]]:
    """The device meshes a call may take (ReaLHF's sub-meshes): an aligned power-of-two block
    inside one node (1, 2, 4, ... devices), or any run of consecutive whole nodes."""
    per_node = min(per_node or n_devices, n_devices)
    out, size = [], 1
    while size < per_node:
        out += [
            tuple(range(s, s + size)) for s in range(0, n_devices - size + 1, size)
            if s // per_node == (s + size - 1) // per_node
        ]  # fmt: skip
        size *= 2
    n_nodes = n_devices // per_node
    for k in range(1, n_nodes + 1):
        out += [tuple(range(s * per_node, (s + k) * per_node)) for s in range(n_nodes - k + 1)]
    return out


def candidates(spec: ModelSpec | None, n_devices: int, per_node: int) -> list[Layout]:
    """Every layout a call of a model with ``spec`` may take (one device for no model): tp a
    power of two within a node, pp any divisor of what tp leaves, dp the rest."""
    if spec is None:
        return [Layout(tuple(range(n_devices)), dp=n_devices)]
    return [lay for mesh in blocks(n_devices, per_node) for lay in layouts_on(mesh, spec, per_node)]


# A call whose sequences reach this many tokens may also split them over cp ranks.
LONG_SEQUENCE = 4096


def call_layouts(
    spec: ModelSpec | None, work: Workload, n_devices: int, per_node: int
) -> list[Layout]:
    """``candidates`` a call may take: dp-only ones on vLLM and DeepSpeed (whole-model ranks),
    ep = 1 for a generate call (the decode engine's replicas do not step together), and on
    rayhf's own engine ``context_splits`` of them (``rayhf.parallel.context``)."""
    out = candidates(spec, n_devices, per_node)
    if work.whole_model_ranks:
        out = [lay for lay in out if lay.tp == 1 and lay.pp == 1]
    if work.kind == "generate":
        return [lay for lay in out if lay.ep == 1]
    # DeepSpeed splits no sequence
    return out if work.whole_model_ranks else out + context_splits(spec, work, out)


def splits_sequences(work: Workload) -> bool:
    """Whether a call may split its sequences over cp ranks: an inference or train call of
    ``LONG_SEQUENCE`` tokens or more."""
    return work.kind != "generate" and work.prompt_len + work.gen_len >= LONG_SEQUENCE


def context_splits(spec: ModelSpec | None, work: Workload, layouts: list[Layout]) -> list[Layout]:
    """For a call that ``splits_sequences``, each of ``layouts`` with ep = 1 again with its
    sequences split over each power of two of its dp ranks that the model's heads allow (none
    otherwise)."""
    if spec is None or not splits_sequences(work):
        return []
    return [
        replace(lay, cp=cp)
        for lay in layouts
        if lay.ep == 1 and lay.cp == 1
        for cp in _powers(lay.dp)[1:]
        if lay.dp % cp == 0 and check_layout(spec, lay.tp, lay.pp, cp=cp) is None
    ]


def layouts_on(mesh: tuple[int, ...], spec: ModelSpec | None, per_node: int) -> list[Layout]:
    """Every layout on ``mesh`` the model takes (tp a power of two within a node, pp any divisor
    of what tp leaves, micro-batches when pipelined); dp over the mesh for no model."""
    if spec is None:
        return [Layout(mesh, dp=len(mesh))]
    out, size = [], len(mesh)
    for tp in _powers(min(size, per_node)):
        for pp in _divisors(size // tp) if size % tp == 0 else []:
            if check_layout(spec, tp, pp) is None:
                dp = size // (tp * pp)
                for n_microbatches in MICRO_BATCHES if pp > 1 else (1,):
                    for ep in _expert_splits(spec, dp):
                        out.append(Layout(mesh, dp, tp, pp, n_microbatches, ep))
                        if ep > 1 and pp > 1:  # the ep group inside a node too
                            order = stage_major(mesh, dp, tp, pp)
                            out.append(Layout(order, dp, tp, pp, n_microbatches, ep))
    return out


def _expert_splits(spec: ModelSpec, dp: int) -> list[int]:
    """The ep a layout of ``dp`` replicas may split the model's experts by (1 for a dense one)."""
    if spec.moe is None:
        return [1]
    return [ep for ep in _divisors(dp) if spec.moe.n_experts % ep == 0]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _powers(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if (1 << k) <= n]


def _neighbour(
    cur: dict[str, Layout],
    problem: Problem,
    options: dict[str, list[Layout]],
    on_mesh: dict[str, dict[tuple[int, ...], list[Layout]]],
    rng: random.Random,
) -> dict[str, Layout]:
    """One random move: a new layout for a call, a layout shared within a role, a call moved to
    another block of the same size, or two calls split onto two parts of a block (so they can
    run at the same time). ``on_mesh``: each call's ``options`` by mesh."""
    graph, specs, per_node = problem.graph, problem.specs, problem.cluster.devices_per_node
    trial = dict(cur)
    name = rng.choice(graph.order)
    role = graph.by_name[name].role
    move = rng.random()
    same_role = [n for n in graph.role_calls(role) if n != name]
    if role not in specs or move < 0.15:
        trial[name] = rng.choice(options[name])
    elif move < 0.3:
        return _place(trial, name, rng.choice(options[name]), graph)
    elif move < 0.5 and same_role:
        trial[name] = trial[rng.choice(same_role)]  # share a layout: no reallocation
    elif move < 0.7:
        lay = trial[name]
        size, n_devices = len(lay.mesh), len(options[name][-1].mesh)
        start = rng.choice(range(0, n_devices - size + 1, min(size, per_node)))
        shift = start - min(lay.mesh)  # the same layout, its rank order kept
        trial[name] = replace(lay, mesh=tuple(d + shift for d in lay.mesh))
    elif len(graph.order) > 1:
        other = rng.choice([n for n in graph.order if n != name])
        block = tuple(sorted(trial[name].mesh))
        if len(block) >= 2 and graph.by_name[other].role in specs:
            cut = len(block) // 2
            if len(block) > per_node:  # whole nodes: cut at any node boundary
                cut = rng.randrange(1, len(block) // per_node) * per_node
            for call, mesh in ((name, block[:cut]), (other, block[cut:])):
                fits = on_mesh[call].get(mesh)
                if fits:
                    trial[call] = rng.choice(fits)
    return trial


@dataclass
class SearchResult:
    plan: Plan
    simulation: Simulation
    iterations: int
    seconds: float


class _Scorer:
    """Energies of plans, memoized (local improvement revisits plans), within a deadline."""

    def __init__(self, problem: Problem, deadline: float) -> None:
        self.problem = problem
        self.graph, self.specs, self.works, self.cost = (
            problem.graph, problem.specs, problem.works, problem.cost
        )  # fmt: skip
        self.capacity = problem.capacity
        self.deadline = deadline
        self.seen: dict[tuple[Layout, ...], float] = {}
        self.evaluations = 0
        self._fastest: dict[tuple[str, tuple[int, ...]], Layout | None] = {}

    def __call__(self, layouts: dict[str, Layout]) -> float:
        key = tuple(layouts[n] for n in self.graph.order)
        if key not in self.seen:
            self.evaluations += 1
            plan = Plan(dict(layouts), "search")
            sim = simulate(self.problem, plan)
            self.seen[key] = energy(sim, self.capacity)
        return self.seen[key]

    def fastest(self, name: str, mesh: tuple[int, ...], options: list[Layout]) -> Layout | None:
        """The layout on ``mesh`` that runs call ``name`` alone fastest."""
        key = (name, mesh)
        if key not in self._fastest:
            spec = self.specs.get(self.graph.by_name[name].role)
            on_mesh = [lay for lay in options if lay.mesh == mesh]
            self._fastest[key] = (
                None
                if spec is None or not on_mesh
                else min(
                    on_mesh, key=lambda lay: self.cost.call(spec, lay, self.works[name]).seconds
                )
            )
        return self._fastest[key]

    def out_of_time(self) -> bool:
        return time.perf_counter() >= self.deadline


def _fitting(problem: Problem, options: dict[str, list[Layout]]) -> dict[str, list[Layout]]:
    """Drop layouts whose call alone overflows a device: no plan with them can fit."""
    cost, works, cap = problem.cost, problem.works, problem.capacity
    out = {}
    for name, opts in options.items():
        spec = problem.spec(name)
        fits = [
            lay for lay in opts
            if spec is None or cost.least_memory(spec, lay, works[name]) <= cap
        ]  # fmt: skip
        out[name] = fits or opts
    return out


def _shortlist(problem: Problem, options: dict[str, list[Layout]], keep: int = 3):
    """Per call and mesh, the ``keep`` layouts that run the call alone fastest: what local
    improvement tries (annealing still draws from every layout)."""
    cost, works = problem.cost, problem.works
    out = {}
    for name, opts in options.items():
        spec = problem.spec(name)
        if spec is None:
            out[name] = opts
            continue
        out[name] = [
            lay
            for group in _by_mesh(opts).values()
            for lay in sorted(group, key=lambda x: cost.call(spec, x, works[name]).seconds)[:keep]
        ]
    return out


def _by_mesh(layouts: list[Layout]) -> dict[tuple[int, ...], list[Layout]]:
    out: dict[tuple[int, ...], list[Layout]] = {}
    for lay in layouts:
        out.setdefault(lay.mesh, []).append(lay)
    return out


def _best_of(cur, e_cur, trials, score: _Scorer):
    """The lowest-energy plan among ``cur`` and ``trials`` (first found wins ties)."""
    for trial in trials:
        if score.out_of_time():
            break
        e = score(trial)
        if e < e_cur:
            cur, e_cur = trial, e
    return cur, e_cur


def _call_moves(cur, name: str, options: dict[str, list[Layout]]):
    for lay in options[name]:
        yield {**cur, name: lay}


def _role_moves(cur, role: str, graph: Graph, options: dict[str, list[Layout]]):
    """Move a role's home and every call that runs at home together (no new reallocation)."""
    calls = graph.role_calls(role)
    home = Plan(cur, "").home_layouts(graph)[role]
    at_home = [c for c in calls if cur[c] == home]
    train = [c for c in calls if graph.by_name[c].kind == "train"]
    for lay in options[(train or calls)[0]]:
        yield {**cur, **{c: lay for c in at_home}}


def _pair_moves(cur, graph: Graph, options: dict[str, list[Layout]], score: _Scorer):
    """Two calls onto two disjoint meshes (so they can run at the same time), each on its
    fastest layout there that fits on its own."""
    names = [n for n in graph.order if len(options[n]) > 1]
    cluster = score.cost.cluster
    for a, b in itertools.permutations(names, 2):
        for pair in side_by_side(cluster.n_devices, cluster.devices_per_node):
            trial = dict(cur)
            for call, mesh in zip((a, b), pair, strict=True):
                fastest = score.fastest(call, mesh, options[call])
                if fastest is not None:
                    trial = _place(trial, call, fastest, graph)
            yield trial


def side_by_side(n_devices: int, per_node: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Pairs of disjoint meshes local improvement tries two calls on: the two halves of every
    aligned power-of-two block of at least an eighth of the cluster, and the whole cluster cut
    at every node boundary (a large actor beside a small critic wants an uneven cut)."""
    out = []
    size = max(2, n_devices // 8)
    while size <= n_devices:
        for s in range(0, n_devices - size + 1, size):
            out.append((tuple(range(s, s + size // 2)), tuple(range(s + size // 2, s + size))))
        size *= 2
    for cut in range(per_node, n_devices, per_node):
        if 2 * cut != n_devices:
            out.append((tuple(range(cut)), tuple(range(cut, n_devices))))
    return out


def _place(cur: dict[str, Layout], name: str, lay: Layout, graph: Graph) -> dict[str, Layout]:
    """``name`` on ``lay``; if it holds its role's home, the calls that run at home follow."""
    role = graph.by_name[name].role
    home = Plan(cur, "").home_layouts(graph)[role]
    if cur[name] != home:
        return {**cur, name: lay}
    return {**cur, **{c: lay for c in graph.role_calls(role) if cur[c] == home}}


def improve(
    layouts: dict[str, Layout], options: dict[str, list[Layout]], graph: Graph, score: _Scorer
) -> tuple[dict[str, Layout], float]:
    """Deterministic local improvement: every call in turn on each of its layouts with the rest
    fixed, every role's home moved with its calls, pairs of calls split over a block; keep the
    best, repeat until nothing improves (or time runs out). Never returns a worse plan."""
    cur, e_cur = dict(layouts), score(layouts)
    while not score.out_of_time():
        before = e_cur
        for name in graph.order:
            cur, e_cur = _best_of(cur, e_cur, _call_moves(cur, name, options), score)
        for role in graph.roles:
            if len(options[graph.role_calls(role)[0]]) > 1:
                cur, e_cur = _best_of(cur, e_cur, _role_moves(cur, role, graph, options), score)
        if e_cur < before:
            continue
        cur, e_cur = _best_of(cur, e_cur, _pair_moves(cur, graph, options, score), score)
        if e_cur >= before:
            break
    return cur, e_cur


def energy(sim: Simulation, capacity: float) -> float:
    if sim.refused:  # an engine that holds whole models given tp or pp: not a plan at all
        return math.inf
    over = sum(max(0.0, b - capacity) for _, _, b in sim.over_memory)
    return sim.iteration_seconds * (1.0 + (10.0 + 10.0 * over / capacity if over else 0.0))


def search(
    problem: Problem,
    starts: list[Plan],
    seed: int = 0,
    max_iterations: int = 20000,
    time_limit: float = 30.0,
) -> SearchResult:
    """The lowest-energy plan found for ``problem``: the best of ``starts``, locally improved,
    then simulated annealing from there, and the annealing's best locally improved again."""
    began = time.perf_counter()
    rng = random.Random(seed)
    graph, specs, works, cluster = problem.graph, problem.specs, problem.works, problem.cluster
    per_node = cluster.devices_per_node
    options = {
        c.name: call_layouts(specs.get(c.role), works[c.name], cluster.n_devices, per_node)
        for c in graph.calls
    }
    options = _fitting(problem, options)
    short = _shortlist(problem, options)
    score = _Scorer(problem, began + time_limit)
    ready = time.perf_counter()  # the phases share what is left of the limit
    left = began + time_limit - ready
    improved = []
    for k, start in enumerate(sorted((dict(p.layouts) for p in starts), key=score)):
        score.deadline = ready + (k + 1) / len(starts) * 0.5 * left  # a share each
        improved.append(improve(start, short, graph, score))
    best, best_e = min(improved, key=lambda r: r[1])
    score.deadline = ready + 0.85 * left
    found, found_e, it = _anneal((best, best_e), options, rng, score, max_iterations)
    if found_e < best_e:
        score.deadline = began + time_limit
        best, best_e = improve(found, short, graph, score)
    sim = simulate(problem, Plan(best, ""))
    plan = Plan(best, "search", dict(sim.stages), released=sim.released)
    return SearchResult(plan, sim, it + score.evaluations, time.perf_counter() - began)


def _anneal(start: tuple[dict[str, Layout], float], options, rng: random.Random, score: _Scorer,
            max_it: int):  # fmt: skip
    """Simulated annealing from ``start`` (a plan's layouts and energy); returns its best plan,
    energy and step count."""
    layouts, start_e = start
    best, best_e = dict(layouts), start_e
    cur, cur_e = dict(layouts), start_e
    temp0 = 0.05 * start_e
    on_mesh = {name: _by_mesh(opts) for name, opts in options.items()}
    it = 0
    while it < max_it and not score.out_of_time():
        it += 1
        trial = _neighbour(cur, score.problem, options, on_mesh, rng)
        e = score(trial)
        temp = temp0 * (1.0 - it / max_it) + 1e-9
        if e < cur_e or rng.random() < math.exp((cur_e - e) / temp):
            cur_e, cur = e, trial
            if e < best_e:
                best_e, best = e, dict(trial)
    return best, best_e, it
