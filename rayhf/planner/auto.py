"""``plan: auto`` for a cluster spec: baselines, search, and what the user sees.

workloads(graph, ...) -> baselines (each tuned) -> search warm-started from them
-> AutoPlan (the chosen plan and every candidate's simulation) -> table / JSON / Gantt
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayhf.errors import RayhfError
from rayhf.graph import Graph
from rayhf.models.spec import ModelSpec, model_spec
from rayhf.planner import baselines
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import ClusterSpec
from rayhf.planner.plan import Plan, heuristic_plan
from rayhf.planner.search import SearchResult, candidates, energy, search
from rayhf.planner.simulate import Simulation, simulate


@dataclass
class AutoPlan:
    chosen: SearchResult
    baselines: dict[str, tuple[Plan, Simulation]]


def workloads(
    graph: Graph,
    batch: int,
    prompt_len: int,
    gen_len: int,
    n_minibatches: int,
    engines: Mapping[str, tuple[str, int, bool]] | None = None,
) -> dict[str, Workload]:
    """Each call's work per step (a generate call that samples a group multiplies nothing here:
    the batch is the step's sequences); ``engines``: call -> (engine, ZeRO stage, offload) of the
    calls not on rayhf's own engines (``ExperimentConfig.engine_of``)."""
    engines = engines or {}
    out = {}
    for c in graph.calls:
        engine, zero, offload = engines.get(c.name, ("", 0, False))
        minibatches = n_minibatches if c.kind == "train" else 1
        out[c.name] = Workload(
            c.kind, batch, prompt_len, gen_len, minibatches, engine, zero, offload
        )
    return out


def check_fits(graph: Graph, specs: dict[str, ModelSpec], works, cost: AnalyticCost) -> None:
    """Refuse a cluster on which some call fits no layout, naming it and its smallest need."""
    cluster = cost.cluster
    capacity = cluster.device.memory_bytes
    for call in graph.calls:
        spec = specs.get(call.role)
        if spec is None:
            continue
        options = candidates(spec, cluster.n_devices, cluster.devices_per_node)
        if works[call.name].whole_model_ranks:
            options = [lay for lay in options if lay.tp == 1 and lay.pp == 1]
        need = min(cost.memory(spec, lay, works[call.name]) for lay in options)
        if need > capacity:
            raise RayhfError(
                f"plan: call '{call.name}' (role '{call.role}') needs at least {need / 1e9:.1f} GB "
                f"per device in any layout on {cluster.n_devices} x {cluster.device.name} "
                f"({capacity / 1e9:.0f} GB each); use more or larger devices, or a smaller batch"
            )


def auto_plan(
    graph: Graph,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cluster: ClusterSpec,
    seed: int = 0,
    time_limit: float = 25.0,
) -> AutoPlan:
    cost = AnalyticCost(cluster)
    check_fits(graph, specs, works, cost)
    cap = cluster.device.memory_bytes

    def score(plan: Plan) -> float:
        return energy(simulate(graph, plan, specs, works, cost), cap)

    n, per = cluster.n_devices, cluster.devices_per_node
    built = {
        "colocated": baselines.colocated(graph, specs, n, per, score),
        "disjoint": baselines.disjoint(graph, specs, n, per, score),
        "realhf": baselines.realhf(graph, specs, cluster.n_nodes, per, score),
    }
    base = {k: (p, simulate(graph, p, specs, works, cost)) for k, p in built.items() if p}
    found = search(
        graph, specs, works, cost, [p for p, _ in base.values()], seed, time_limit=time_limit
    )
    if not found.simulation.feasible:
        what, device, need = found.simulation.over_memory[0]
        raise RayhfError(
            f"plan: no plan found that fits memory; call '{what}' needs {need / 1e9:.1f} GB on "
            f"device {device} ({cap / 1e9:.0f} GB)"
        )
    return AutoPlan(found, base)


def format_auto(result: AutoPlan) -> str:
    sim = result.chosen.simulation
    rows = [
        f"estimated iteration: {sim.iteration_seconds:.2f} s (search: {result.chosen.iterations} "
        f"steps in {result.chosen.seconds:.1f} s); peak memory per device: "
        f"{max(sim.peak_memory.values(), default=0) / 1e9:.1f} GB",
        "baselines (same cost model):",
    ]
    for name, (_, bsim) in result.baselines.items():
        fits = "" if bsim.feasible else " (does not fit memory)"
        speed = bsim.iteration_seconds / sim.iteration_seconds
        rows.append(f"  {name:<10}{bsim.iteration_seconds:>9.2f} s  ({speed:.2f}x the plan){fits}")
    return "\n".join(rows)


def write_gantt(sim: Simulation, out: Path, iteration: int = 1) -> Path:
    """A Gantt chart of one simulated iteration: a row per device, a bar per call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [s for s in sim.spans if s.iteration == iteration]
    names = sorted({s.name for s in spans})
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    devices = sorted({d for s in spans for d in s.devices})
    fig, ax = plt.subplots(figsize=(10, 1 + 0.25 * len(devices)))
    for s in spans:
        for d in s.devices:
            ax.barh(d, s.end - s.start, left=s.start, color=colors[s.name], edgecolor="none")
    ax.set_xlabel("seconds")
    ax.set_ylabel("device")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
    ax.legend(handles, names, fontsize=7, loc="upper right", ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


AUTO_ITERATIONS = 3000  # search steps for ``plan: auto`` (a fixed count keeps runs reproducible)


def profile_cache() -> Path:
    """Where measured model profiles are kept (``RAYHF_CACHE_DIR`` overrides)."""
    import os

    root = os.environ.get("RAYHF_CACHE_DIR") or Path.home() / ".cache" / "rayhf"
    return Path(root) / "profiles"


def plan_for_run(
    graph: Graph,
    configs: dict[str, tuple[Any, bool]],
    works: dict[str, Workload],
    cluster: ClusterConfig,
    seed: int = 0,
) -> Plan:
    """``plan: auto`` for a run on emulated CPU devices: profile every role's model on this
    machine (cached), then search with the profiled cost of rayhf's driver, which runs calls on
    disjoint meshes at the same time. ``configs``: role -> (Hugging Face config, value head)."""
    import os

    from rayhf.planner.hardware import CPU_ACTOR, CPU_CALL_OVERHEAD, cpu_cluster
    from rayhf.planner.profile import ProfiledCost, profile_model

    n = cluster.n_devices
    if n == 1 or cluster.device == "cuda":  # one possible plan; GPUs: see docs/decisions.md
        return Plan(heuristic_plan(graph, n).layouts, "auto")
    threads = max(1, int((cluster.num_cpus or os.cpu_count() or 1) / n))
    profiles, specs = {}, {}
    for role, (config, value_head) in configs.items():
        specs[role] = model_spec(config, value_head)
        key = dataclasses.replace(specs[role], n_layers=0)
        profiles[key] = profile_model(config, value_head, threads, profile_cache())
    spec = cpu_cluster(n, cluster.device_memory_gb)
    cost = ProfiledCost(spec, profiles, CPU_CALL_OVERHEAD, CPU_ACTOR)
    check_fits(graph, specs, works, cost)

    def score(plan: Plan) -> float:
        sim = simulate(graph, plan, specs, works, cost)
        return energy(sim, spec.device.memory_bytes)

    starts = [
        baselines.colocated(graph, specs, n, n, score),
        baselines.disjoint(graph, specs, n, n, score),
    ]
    found = search(graph, specs, works, cost, starts, seed, AUTO_ITERATIONS)
    return Plan(found.plan.layouts, "auto")
