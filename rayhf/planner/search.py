"""Plan search: simulated annealing over every call's layout, warm-started from the baselines.

Candidates for a call: a block of devices (sizes 1, 2, 4, ... aligned to their size, so a block
never straddles nodes needlessly) x every ``dp x tp x pp`` of that size the model can take (tp
within a node) x micro-batches. The energy of a plan is its simulated iteration time; a plan
that does not fit memory costs its time plus a penalty that grows with the overflow, so the
search walks out of infeasible regions. Deterministic for a seed; bounded by iterations and a
time limit.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from rayhf.graph import Graph
from rayhf.models.sharding import check_layout
from rayhf.models.spec import ModelSpec
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.layout import Layout
from rayhf.planner.plan import Plan
from rayhf.planner.simulate import Simulation, simulate

MICRO_BATCHES = (1, 2, 4, 8)


def blocks(n_devices: int) -> list[tuple[int, ...]]:
    """Aligned power-of-two blocks of devices: (0), (1), ..., (0, 1), (2, 3), ..., all."""
    out, size = [], 1
    while size <= n_devices:
        out += [tuple(range(s, s + size)) for s in range(0, n_devices - size + 1, size)]
        size *= 2
    return out


def candidates(spec: ModelSpec | None, n_devices: int, per_node: int) -> list[Layout]:
    """Every layout a call of a model with ``spec`` may take (one device for no model)."""
    if spec is None:
        return [Layout(tuple(range(n_devices)), dp=n_devices)]
    out = []
    for mesh in blocks(n_devices):
        size = len(mesh)
        for tp in _powers(min(size, per_node)):
            for pp in _powers(size // tp):
                if check_layout(spec, tp, pp) is not None:
                    continue
                for n_mbs in MICRO_BATCHES if pp > 1 else (1,):
                    out.append(Layout(mesh, size // (tp * pp), tp, pp, n_mbs))
    return out


def _powers(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if (1 << k) <= n]


@dataclass
class SearchResult:
    plan: Plan
    simulation: Simulation
    iterations: int
    seconds: float


def _neighbour(
    cur: dict[str, Layout],
    graph: Graph,
    options: dict[str, list[Layout]],
    specs: dict[str, ModelSpec],
    per_node: int,
    rng: random.Random,
) -> dict[str, Layout]:
    """One random move: a new layout for a call, a layout shared within a role, a call moved to
    another block of the same size, or two calls split onto the two halves of a block (so they
    can run at the same time)."""
    trial = dict(cur)
    name = rng.choice(graph.order)
    role = graph.by_name[name].role
    move = rng.random()
    same_role = [n for n in graph.role_calls(role) if n != name]
    if move < 0.3 or role not in specs:
        trial[name] = rng.choice(options[name])
    elif move < 0.5 and same_role:
        trial[name] = trial[rng.choice(same_role)]  # share a layout: no reallocation
    elif move < 0.7:
        lay = trial[name]
        size = len(lay.mesh)
        starts = range(0, len(options[name][-1].mesh) - size + 1, size) if size else [0]
        start = rng.choice(list(starts))
        trial[name] = Layout(tuple(range(start, start + size)), lay.dp, lay.tp, lay.pp, lay.n_mbs)
    else:
        other = rng.choice([n for n in graph.order if n != name])
        block = trial[name].mesh
        if len(block) >= 2 and graph.by_name[other].role in specs:
            half = len(block) // 2
            for call, mesh in ((name, block[:half]), (other, block[half:])):
                fits = [lay for lay in options[call] if lay.mesh == mesh]
                if fits:
                    trial[call] = rng.choice(fits)
    return trial


def energy(sim: Simulation, capacity: float) -> float:
    over = sum(max(0.0, b - capacity) for _, _, b in sim.over_memory)
    return sim.iteration_seconds * (1.0 + (10.0 + 10.0 * over / capacity if over else 0.0))


def search(
    graph: Graph,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cost: AnalyticCost,
    starts: list[Plan],
    seed: int = 0,
    max_iterations: int = 20000,
    time_limit: float = 30.0,
) -> SearchResult:
    """The lowest-energy plan found, starting from the best of ``starts``."""
    began = time.perf_counter()
    rng = random.Random(seed)
    cluster = cost.cluster
    capacity = cluster.device.memory_bytes
    options = {
        c.name: candidates(specs.get(c.role), cluster.n_devices, cluster.devices_per_node)
        for c in graph.calls
    }

    def evaluate(layouts: dict[str, Layout]) -> tuple[float, Simulation]:
        sim = simulate(graph, Plan(layouts, "search"), specs, works, cost)
        return energy(sim, capacity), sim

    scored = [(*evaluate(dict(p.layouts)), dict(p.layouts)) for p in starts]
    best_e, best_sim, best = min(scored, key=lambda s: s[0])
    cur_e, cur = best_e, dict(best)
    temp0 = 0.05 * best_e
    it = 0
    while it < max_iterations and time.perf_counter() - began < time_limit:
        it += 1
        trial = _neighbour(cur, graph, options, specs, cluster.devices_per_node, rng)
        e, sim = evaluate(trial)
        temp = temp0 * (1.0 - it / max_iterations) + 1e-9
        if e < cur_e or rng.random() < math.exp((cur_e - e) / temp):
            cur_e, cur = e, trial
            if e < best_e:
                best_e, best_sim, best = e, sim, dict(trial)
    return SearchResult(Plan(best, "search"), best_sim, it, time.perf_counter() - began)
