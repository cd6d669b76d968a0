"""``plan: auto`` for a cluster spec: baselines, search, and what the user sees.

workloads(graph, ...) -> baselines (each tuned) -> search warm-started from them
-> AutoPlan (the chosen plan and every candidate's simulation) -> table / JSON / Gantt
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rayhf.engines.config import EngineConfig
from rayhf.errors import RayhfError
from rayhf.graph import Graph
from rayhf.models.sharding import check_layout
from rayhf.models.spec import ModelSpec
from rayhf.planner import baselines
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import (
    CPU_ACTOR,
    CPU_CALL_OVERHEAD,
    ClusterSpec,
    cpu_cluster,
    gpu_cluster,
)
from rayhf.planner.plan import Plan, colocated_plan
from rayhf.planner.profile import ModelProfile, ProfiledCost
from rayhf.planner.search import SearchResult, _powers, candidates, search
from rayhf.planner.simulate import Simulation, simulate
from rayhf.planner.step import StepOptions


@dataclass
class AutoPlan:
    chosen: SearchResult
    baselines: dict[str, tuple[Plan, Simulation]]
    absent: list[str] = field(default_factory=list)  # baselines with no plan for this setup
    device_use: list[str] = field(default_factory=list)  # roles on fewer than all devices, why


def workloads(
    graph: Graph,
    batch: int,
    prompt_len: int,
    gen_len: int,
    n_minibatches: int,
    engines: Mapping[str, EngineConfig] | None = None,
    zero1_roles: Collection[str] = (),
    checkpointing_roles: Collection[str] = (),
) -> dict[str, Workload]:
    """Each call's work per step (a generate call that samples a group multiplies nothing here:
    the batch is the step's sequences); ``engines``: call -> its backend (default: its kind's,
    and its token budget); ``zero1_roles``: roles whose torch optimizer shards its state over
    dp (ZeRO-1); ``checkpointing_roles``: roles that recompute activations in backward."""
    engines = engines or {}
    out = {}
    for c in graph.calls:
        engine = engines.get(c.name) or EngineConfig.default(c.kind)
        minibatches = n_minibatches if c.kind == "train" else 1
        zero = engine.zero_stage_for(c.role in zero1_roles) if c.kind == "train" else 0
        named = engine.engine if engine.whole_model_ranks else ""
        out[c.name] = Workload(
            c.kind, batch, prompt_len, gen_len, minibatches, named, zero, engine.offload,
            checkpointing=c.kind == "train" and c.role in checkpointing_roles,
            token_budget=engine.max_tokens_per_microbatch or 0,
        )  # fmt: skip
    return out


def open_stages(works: Mapping[str, Workload]) -> dict[str, Workload]:
    """On a cluster planned for, a train call may take any ZeRO stage its engines offer: 0-1
    on rayhf's torch engine (any layout), 1-3 on DeepSpeed (dp only); the plan names it."""
    return {
        name: dataclasses.replace(w, zero_choices=(1, 2, 3) if w.engine else (0, 1, 2, 3))
        if w.kind == "train" and w.engine in ("", "deepspeed")
        else w
        for name, w in works.items()
    }


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
        need = min(cost.least_memory(spec, lay, works[call.name]) for lay in options)
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
    time_limit: float = 20.0,
    step: StepOptions = StepOptions(),
) -> AutoPlan:
    began = time.perf_counter()
    cost = AnalyticCost(cluster)
    works = open_stages(works)
    check_fits(graph, specs, works, cost)
    cap = cluster.device.memory_bytes
    built = baselines.build_all(baselines.Setting.priced(graph, specs, works, cost, step))
    base = {
        k: (p, simulate(graph, p, specs, works, cost, step=step)) for k, p in built.items() if p
    }
    starts = [p for p, _ in base.values()]
    left = max(5.0, time_limit - (time.perf_counter() - began))  # the search gets what is left
    found = search(graph, specs, works, cost, starts, seed, time_limit=left, step=step)
    if not found.simulation.feasible:
        what, device, need = found.simulation.over_memory[0]
        raise RayhfError(
            f"plan: no plan found that fits memory; call '{what}' needs {need / 1e9:.1f} GB on "
            f"device {device} ({cap / 1e9:.0f} GB)"
        )
    absent = [k for k, p in built.items() if p is None]
    return AutoPlan(found, base, absent, device_use(graph, found.plan, specs, works, cluster))


def device_use(
    graph: Graph,
    plan: Plan,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cluster: ClusterSpec,
) -> list[str]:
    """A line per role whose calls use fewer than all devices: how many, and why (what the
    model and the batch allow at most, else that the search found fewer faster)."""
    n, per = cluster.n_devices, cluster.devices_per_node
    out = []
    for role, spec in specs.items():
        calls = [c.name for c in graph.calls if c.role == role]
        used = {d for name in calls for d in plan.layouts[name].mesh}
        if not calls or len(used) == n:
            continue
        tp = max(t for t in _powers(per) if check_layout(spec, t, 1) is None)
        pp = max(p for p in range(1, spec.n_layers + 1) if check_layout(spec, 1, p) is None)
        dp = max(works[name].n_seqs for name in calls)
        most = tp * pp * dp
        why = (
            f"the model takes at most tp={tp} (its heads), pp={pp} (its layers) and dp={dp} "
            f"(sequences per step): {most} devices"
            if most < n
            else "the search found this faster in the cost model (other calls use the rest)"
        )
        out.append(f"  {role}: {len(used)} of {n} devices; {why}")
    return out


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
    for name in result.absent:
        rows.append(f"  {name:<10} no plan: its layouts do not fit this graph, cluster or model")
    if result.device_use:
        rows += ["devices per role (where fewer than all):", *result.device_use]
    return "\n".join(rows)


def step_estimates(
    graph: Graph,
    specs: dict[str, ModelSpec],
    works: dict[str, Workload],
    cluster: ClusterSpec,
    chosen: AutoPlan,
    step: StepOptions,
    seed: int = 0,
    time_limit: float = 20.0,
    on_policy_works: dict[str, Workload] | None = None,
) -> list[str]:
    """The estimated seconds per step one at a time, overlapped, and with ``step.staleness``
    asynchronous, each on the fastest plan the search finds for it (one step at a time: the
    overlapped plan's steps in turn); ``chosen`` was searched with ``step`` and ``works``, the
    on-policy ways are priced with ``on_policy_works`` (default ``works``: the work at k=0,
    without the proximal forward a policy's train call makes at k >= 1)."""
    k = step.staleness
    synced_works = on_policy_works or works
    on_policy = dataclasses.replace(step, overlap=True, staleness=0)
    synced = (
        auto_plan(graph, specs, synced_works, cluster, seed, time_limit, on_policy) if k else chosen
    )
    cost, plan = AnalyticCost(cluster), synced.chosen.plan
    one_by_one = dataclasses.replace(on_policy, overlap=False)
    barrier = simulate(graph, plan, specs, open_stages(synced_works), cost, step=one_by_one)
    overlapped = synced.chosen.simulation.iteration_seconds
    rows = [
        ("one step at a time", barrier.iteration_seconds),
        ("overlapped (on-policy)", overlapped),
    ]
    if k:
        rows.append(
            (f"asynchronous (max_staleness {k})", chosen.chosen.simulation.iteration_seconds)
        )
    lines = ["seconds per step, each way of running steps on its own best plan:"]
    lines += [f"  {name:<32}{s:>9.2f} s  ({overlapped / s:.2f}x overlapped)" for name, s in rows]
    return lines


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


# The driver's cost of one call on GPUs (dispatch, splitting and joining the batch, Ray): host
# work, so the CPU figure until a multi-GPU machine fits its own (benchmarks/planner_calibration)
GPU_CALL_OVERHEAD = CPU_CALL_OVERHEAD


def searches(cluster: ClusterConfig) -> bool:
    """Whether ``plan: auto`` searches for this run's cluster; else (one device) it is the
    colocated plan, the only one."""
    return cluster.n_devices > 1


def plan_for_run(
    graph: Graph,
    specs: dict[str, ModelSpec],
    profiles: dict[ModelSpec, ModelProfile],
    works: dict[str, Workload],
    cluster: ClusterConfig,
    seed: int = 0,
    step: StepOptions = StepOptions(),
    shm: bool = True,
    device_name: str = "",
    ipc: bool = False,
) -> Plan:
    """``plan: auto`` for a run: search with the profiled cost of rayhf's driver (which runs
    units on disjoint meshes at the same time, and with ``step.overlap`` the next step's as its
    dataflow allows), from the measured ``profiles`` of the roles' model shapes
    (``rayhf.runtime.profiling``, on the devices the run uses). Emulated CPU devices: this
    machine's measured links; ``shm``: weight moves go through shared memory. GPUs (named
    ``device_name``): their kind's datasheet links (a kind ``DEVICES`` lacks keeps the colocated
    plan); ``ipc``: moves on one GPU through CUDA IPC. The plan carries its and the colocated
    plan's estimated seconds per step."""
    n = cluster.n_devices
    colocated = Plan(colocated_plan(graph, n).layouts, "auto")
    if not searches(cluster):
        return colocated
    if cluster.device == "cuda":
        gpus = gpu_cluster(n, device_name, ipc=ipc)
        if gpus is None:
            return colocated
        cost: ProfiledCost = ProfiledCost(gpus, profiles, GPU_CALL_OVERHEAD)
    else:
        cores = cluster.num_cpus or os.cpu_count() or 1
        spec = cpu_cluster(n, cluster.device_memory_gb, cores, shm)
        cost = ProfiledCost(spec, profiles, CPU_CALL_OVERHEAD, CPU_ACTOR)
    check_fits(graph, specs, works, cost)

    setting = baselines.Setting.priced(graph, specs, works, cost, step)
    starts = [baselines.colocated(setting), baselines.disjoint(setting)]
    found = search(graph, specs, works, cost, starts, seed, AUTO_ITERATIONS, step=step)
    estimates = {
        "auto": found.simulation.iteration_seconds,
        "colocated": simulate(graph, colocated, specs, works, cost, step=step).iteration_seconds,
    }
    return Plan(found.plan.layouts, "auto", estimates=estimates)
