"""``plan: auto`` for a cluster spec: baselines, search, and what the user sees.

workloads(graph, ...) -> Problem (with the cost model of the cluster and the step)
-> baselines (each tuned) -> search warm-started from them
-> AutoPlan (the chosen plan and every candidate's simulation) -> table / JSON / Gantt
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rayhf.engines.config import EngineConfig, default_engine
from rayhf.errors import RayhfError
from rayhf.graph import Graph
from rayhf.models.sharding import check_layout
from rayhf.models.spec import ModelSpec
from rayhf.planner import baselines
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.cost import Workload
from rayhf.planner.hardware import CPU_ACTOR, CPU_CALL_OVERHEAD, cpu_cluster, gpu_cluster
from rayhf.planner.plan import Plan, colocated_plan
from rayhf.planner.problem import Problem
from rayhf.planner.profile import ModelProfile, ProfiledCost
from rayhf.planner.search import SearchResult, _powers, call_layouts, search
from rayhf.planner.simulate import Simulation, simulate


@dataclass
class AutoPlan:
    chosen: SearchResult
    baselines: dict[str, tuple[Plan, Simulation]]
    absent: list[str] = field(default_factory=list)  # baselines with no plan for this setup
    device_use: list[str] = field(default_factory=list)  # roles on fewer than all devices, why


@dataclass(frozen=True)
class StepBatch:
    """The step's batch as every call sees it."""

    n_seqs: int  # sequences per step (a generate call that samples a group multiplies nothing)
    prompt_len: int
    gen_len: int  # new tokens per sequence
    n_minibatches: int = 1  # optimizer steps per train call (per epoch)


def workloads(
    graph: Graph,
    step_batch: StepBatch,
    engines: Mapping[str, EngineConfig] | None = None,
    zero1_roles: Collection[str] = (),
    checkpointing_roles: Collection[str] = (),
) -> dict[str, Workload]:
    """Each call's work per step on ``step_batch``; ``engines``: call -> its backend (default:
    its kind's, and its token budget); ``zero1_roles``: roles whose torch optimizer shards its
    state over dp (ZeRO-1); ``checkpointing_roles``: roles that recompute activations in
    backward."""
    batch, prompt_len, gen_len = step_batch.n_seqs, step_batch.prompt_len, step_batch.gen_len
    n_minibatches = step_batch.n_minibatches
    engines = engines or {}
    out = {}
    for c in graph.calls:
        engine = engines.get(c.name) or default_engine(c.kind)
        minibatches = n_minibatches if c.kind == "train" else 1
        zero = engine.zero_stage_for(c.role in zero1_roles) if c.kind == "train" else 0
        out[c.name] = Workload(
            c.kind, batch, prompt_len, gen_len, minibatches, engine, zero,
            engine.offloads_optimizer,
            checkpointing=c.kind == "train" and c.role in checkpointing_roles,
            token_budget=engine.token_budget or 0,
        )  # fmt: skip
    return out


def open_stages(
    works: Mapping[str, Workload], experts: Collection[str] = (), adapters: Collection[str] = ()
) -> dict[str, Workload]:
    """On a cluster planned for, a train call may take any ZeRO stage its engines offer: 0-1
    on rayhf's torch engine (any layout), 1-3 on DeepSpeed (dp only), and the plan names it;
    a call in ``experts`` (its role's model is a Mixture-of-Experts one) or in ``adapters``
    (its role trains LoRA adapters) only the stages whose engine runs such a model."""
    out = dict(works)
    for name, w in works.items():
        if w.kind == "train" and w.engine.zero_choices:
            stages = tuple(
                s
                for s in w.engine.zero_choices
                if w.engine.offers_stage(s)
                and (name not in experts or w.engine.at_zero_stage(s).runs_experts)
                and (name not in adapters or w.engine.at_zero_stage(s).runs_adapters)
            )
            out[name] = dataclasses.replace(w, zero_choices=stages)
    return out


def expert_calls(problem: Problem) -> frozenset[str]:
    """The calls whose role's model is a Mixture-of-Experts one."""
    return frozenset(
        c.name
        for c in problem.graph.calls
        if (spec := problem.specs.get(c.role)) is not None and spec.moe is not None
    )


def adapter_calls(problem: Problem) -> frozenset[str]:
    """The calls whose role's model carries LoRA adapters."""
    return frozenset(
        c.name
        for c in problem.graph.calls
        if (spec := problem.specs.get(c.role)) is not None and spec.lora is not None
    )


def check_fits(problem: Problem) -> None:
    """Refuse a cluster on which some call fits no layout, naming it and its smallest need."""
    specs, works, cost, cluster = problem.specs, problem.works, problem.cost, problem.cluster
    capacity = problem.capacity
    for call in problem.graph.calls:
        spec = specs.get(call.role)
        if spec is None:
            continue
        work = works[call.name]
        options = call_layouts(spec, work, cluster.n_devices, cluster.devices_per_node)
        need = min(cost.least_memory(spec, lay, work) for lay in options)
        if need > capacity:
            raise RayhfError(
                f"plan: call '{call.name}' (role '{call.role}') needs at least {need / 1e9:.1f} GB "
                f"per device in any layout on {cluster.n_devices} x {cluster.device.name} "
                f"({capacity / 1e9:.0f} GB each); use more or larger devices, or a smaller batch"
            )


def auto_plan(problem: Problem, seed: int = 0, time_limit: float = 20.0) -> AutoPlan:
    """The searched plan for ``problem`` (its train calls free to take any ZeRO stage their
    engines offer) beside every baseline, all priced by its cost model."""
    began = time.perf_counter()
    opened = open_stages(problem.works, expert_calls(problem), adapter_calls(problem))
    problem = problem.with_works(opened)
    check_fits(problem)
    cap = problem.capacity
    built = baselines.build_all(baselines.Setting.priced(problem))
    base = {k: (p, simulate(problem, p)) for k, p in built.items() if p}
    starts = [p for p, _ in base.values()]
    left = max(5.0, time_limit - (time.perf_counter() - began))  # the search gets what is left
    found = search(problem, starts, seed, time_limit=left)
    if not found.simulation.feasible:
        what, device, need = found.simulation.over_memory[0]
        raise RayhfError(
            f"plan: no plan found that fits memory; call '{what}' needs {need / 1e9:.1f} GB on "
            f"device {device} ({cap / 1e9:.0f} GB)"
        )
    absent = [k for k, p in built.items() if p is None]
    return AutoPlan(found, base, absent, device_use(problem, found.plan))


def device_use(problem: Problem, plan: Plan) -> list[str]:
    """A line per role whose calls use fewer than all devices: how many, and why (what the
    model and the batch allow at most, else that the search found fewer faster)."""
    graph, specs, works = problem.graph, problem.specs, problem.works
    n, per = problem.cluster.n_devices, problem.cluster.devices_per_node
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
    width = max([10, *(len(n) + 1 for n in [*result.baselines, *result.absent])])
    for name, (_, bsim) in result.baselines.items():
        fits = "" if bsim.feasible else " (does not fit memory)"
        speed = bsim.iteration_seconds / sim.iteration_seconds
        seconds = f"{bsim.iteration_seconds:>9.2f} s"
        rows.append(f"  {name:<{width}}{seconds}  ({speed:.2f}x the plan){fits}")
    for name in result.absent:
        rows.append(
            f"  {name:<{width}} no plan: its layouts do not fit this graph, cluster or model"
        )
    if result.device_use:
        rows += ["devices per role (where fewer than all):", *result.device_use]
    return "\n".join(rows)


def step_estimates(
    problem: Problem,
    chosen: AutoPlan,
    seed: int = 0,
    time_limit: float = 20.0,
    on_policy_works: Mapping[str, Workload] | None = None,
) -> list[str]:
    """The estimated seconds per step one at a time, overlapped, and with the problem's
    ``step.staleness`` asynchronous, each on the fastest plan the search finds for it (one step
    at a time: the overlapped plan's steps in turn); ``chosen`` was searched for ``problem``,
    the on-policy ways are priced with ``on_policy_works`` (default the problem's: the work at
    k=0, without the proximal forward a policy's train call makes at k >= 1)."""
    step = problem.step
    k = step.staleness
    synced_works = on_policy_works or problem.works
    on_policy = dataclasses.replace(step, overlap=True, staleness=0)
    synced_problem = problem.with_works(synced_works).with_step(on_policy)
    synced = auto_plan(synced_problem, seed, time_limit) if k else chosen
    plan = synced.chosen.plan
    one_by_one = dataclasses.replace(on_policy, overlap=False)
    stages = open_stages(synced_works, expert_calls(problem), adapter_calls(problem))
    opened = synced_problem.with_works(stages)
    barrier = simulate(opened.with_step(one_by_one), plan)
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


@dataclass(frozen=True)
class RunDevices:
    """The devices a run plans for, and how its weight moves travel."""

    cluster: ClusterConfig
    device_name: str = ""  # the GPUs' name (``torch.cuda.get_device_name``); "" for none seen
    shm: bool = True  # emulated CPU devices: weight moves go through shared memory
    ipc: bool = False  # GPUs: moves on one GPU go through CUDA IPC


def run_cost(devices: RunDevices, profiles: dict[ModelSpec, ModelProfile]) -> ProfiledCost | None:
    """The profiled cost of rayhf's driver on a run's devices, from the measured ``profiles``
    of the roles' model shapes (``rayhf.runtime.profiling``, on the devices the run uses).
    Emulated CPU devices: this machine's measured links. GPUs: their kind's datasheet links.
    None where ``plan: auto`` keeps the colocated plan: one device, or GPUs of a kind
    ``DEVICES`` lacks."""
    cluster, n = devices.cluster, devices.cluster.n_devices
    if not searches(cluster):
        return None
    if cluster.device == "cuda":
        gpus = gpu_cluster(n, devices.device_name, ipc=devices.ipc)
        return None if gpus is None else ProfiledCost(gpus, profiles, GPU_CALL_OVERHEAD)
    cores = cluster.num_cpus or os.cpu_count() or 1
    spec = cpu_cluster(n, cluster.device_memory_gb, cores, devices.shm)
    return ProfiledCost(spec, profiles, CPU_CALL_OVERHEAD, CPU_ACTOR)


def colocated_for_run(graph: Graph, n_devices: int) -> Plan:
    """The plan ``plan: auto`` keeps where it does not search (``run_cost`` is None)."""
    return Plan(colocated_plan(graph, n_devices).layouts, "auto")


def plan_for_run(problem: Problem, seed: int = 0) -> Plan:
    """``plan: auto`` for a run: search ``problem``, priced by ``run_cost`` (rayhf's driver
    runs units on disjoint meshes at the same time, and with ``step.overlap`` the next step's
    as its dataflow allows). The plan carries its and the colocated plan's estimated seconds
    per step."""
    colocated = colocated_for_run(problem.graph, problem.cluster.n_devices)
    check_fits(problem)
    setting = baselines.Setting.priced(problem)
    starts = [baselines.colocated(setting), baselines.disjoint(setting)]
    found = search(problem, starts, seed, AUTO_ITERATIONS)
    estimates = {
        "auto": found.simulation.iteration_seconds,
        "colocated": simulate(problem, colocated).iteration_seconds,
    }
    return Plan(found.plan.layouts, "auto", estimates=estimates, released=found.plan.released)
