"""From an experiment config to the planner's inputs, and ``plan: auto`` for a run.

config + graph (+ the dataset, when there is one) -> planner_workloads: each call's work
    per step, its engine and how its optimizer shards (one definition: ``rayhf run``,
    ``rayhf plan`` and ``plan: auto`` all call it)
-> step_options: the step as the driver runs it (EMA blends, overlap, max_staleness)
-> plan: auto: profile every role's model shape on this machine (cached), search, and keep
   the plan in the run directory so a resumed run keeps it
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from transformers import AutoConfig

from rayhf.algorithms.interface import WorkShape
from rayhf.config import ExperimentConfig
from rayhf.config.registry import INTERFACES
from rayhf.data.datasets import PromptDataset
from rayhf.engines.config import EngineConfig
from rayhf.graph import Graph
from rayhf.models.lora import with_lora
from rayhf.models.spec import ModelSpec
from rayhf.planner.auto import (
    RunDevices,
    StepBatch,
    colocated_for_run,
    plan_for_run,
    run_cost,
    searches,
    workloads,
)
from rayhf.planner.cost import Workload
from rayhf.planner.plan import Plan, plan_from_json
from rayhf.planner.problem import Problem
from rayhf.planner.profile import ModelProfile
from rayhf.planner.step import StepOptions, leading, plan_step
from rayhf.runtime.profiling import gpu_profiles, profiles_for

PLAN_FILE = "plan.json"


def call_engines(cfg: ExperimentConfig, graph: Graph) -> dict[str, EngineConfig]:
    """Every call's backend: its ``engines:`` entry, else its kind's default."""
    return {c.name: cfg.engine_of(c.name, c.kind) for c in graph.calls}


def step_options(cfg: ExperimentConfig, device: str | None = None) -> StepOptions:
    """The step as the driver will run it on ``device`` (default: the run's): each EMA role
    blended toward the role it follows, and whether steps overlap (only plain calls do)."""
    followers: dict[str, list[tuple[str, float]]] = {}
    for role, rc in cfg.models.items():
        if rc.init_from is not None and rc.ema is not None:
            followers.setdefault(rc.init_from, []).append((role, rc.ema))
    device = device or cfg.cluster.device
    overlap = cfg.driver.overlap_steps and not cfg.driver.compiled(device)
    return StepOptions(followers, overlap, staleness(cfg))


def staleness(cfg: ExperimentConfig) -> int:
    """``algorithm.max_staleness`` (0 for an algorithm without it)."""
    return int(getattr(cfg.algorithm, "max_staleness", 0))


def check_staleness(cfg: ExperimentConfig, graph: Graph, plan: Plan) -> None:
    """With ``max_staleness`` > 0 the policy's generation must be able to run ahead of the
    rest of its step under ``plan`` (one RayhfError line naming the call otherwise)."""
    if staleness(cfg):
        homes = plan.home_layouts(graph)
        units = plan_step(graph, plan.layouts, homes, step_options(cfg))
        leading(graph, units, staleness(cfg))


def prompt_tokens(cfg: ExperimentConfig, dataset: PromptDataset | None) -> int:
    """The prompt length the planner prices: the dataset's mean, or (no dataset yet) the
    config's bound ``dataset.max_prompt_len``."""
    if dataset is None:
        return cfg.dataset.max_prompt_len
    return round(dataset.mean_prompt_len())


def response_tokens(cfg: ExperimentConfig, prompt: int) -> int:
    """Tokens a sequence holds after its prompt, as priced: ``max_new_tokens``, or with an
    ``env:`` every turn's (``max_turns`` of them) within ``env.max_tokens``. The environment's
    own messages and its seconds occupy no device and are not priced."""
    new = cfg.generation.max_new_tokens
    if cfg.env is None:
        return new
    return max(1, min(cfg.env.max_turns * new, cfg.env.max_tokens - prompt))


def call_shapes(cfg: ExperimentConfig, graph: Graph) -> dict[str, WorkShape]:
    """Each call's work beyond one pass over the step's batch, as its interface runs it under
    the run's algorithm (a group of samples per prompt, epochs, a proximal forward)."""
    out = {}
    for c in graph.calls:
        iface = INTERFACES.get(c.interface)
        shape = iface.work_shape(cfg.algorithm, c.kind) if iface else WorkShape()
        if iface is not None and iface.needs_judge and cfg.judge is not None:
            shape = dataclasses.replace(shape, new_tokens=cfg.judge.max_new_tokens)
        out[c.name] = shape
    return out


def planner_workloads(
    cfg: ExperimentConfig, graph: Graph, dataset: PromptDataset | None
) -> dict[str, Workload]:
    """Each call's work per step as the planner prices it: every call sees the step's
    sequences (the prompts times the responses sampled per prompt). A call that reads the
    answers (a judge's) is priced with each prompt and response as its prompt, and its own
    new tokens; its template's words are not counted."""
    minibatches = getattr(cfg.algorithm, "n_minibatches", 1)
    zero1 = {role for role, rc in cfg.models.items() if rc.optimizer.zero1}
    recompute = {role for role, rc in cfg.models.items() if rc.activation_checkpointing}
    shapes = call_shapes(cfg, graph)
    seqs = cfg.batch_size * max((s.samples_per_prompt for s in shapes.values()), default=1)
    prompt = prompt_tokens(cfg, dataset)
    response = response_tokens(cfg, prompt)
    batch = StepBatch(seqs, prompt, response, minibatches)
    works = workloads(graph, batch, call_engines(cfg, graph), zero1, recompute)
    out = {}
    for name, w in works.items():
        s = shapes[name]
        w = dataclasses.replace(w, epochs=s.epochs, forward_share=s.forward_share)
        if s.reads_answers:
            new = s.new_tokens or response
            w = dataclasses.replace(w, prompt_len=prompt + response, gen_len=new)
        out[name] = w
    return out


def auto_plan(
    cfg: ExperimentConfig,
    graph: Graph,
    model_dirs: dict[str, Path],
    dataset: PromptDataset,
    run_dir: Path,
) -> Plan:
    """The planner's choice for this run, kept in the run directory so a resumed run keeps it."""
    saved = run_dir / PLAN_FILE
    if saved.exists():  # a resumed run keeps its plan (if it still fits the graph and cluster)
        plan = plan_from_json(saved.read_text(), "auto")
        meshes = {d for lay in plan.layouts.values() for d in lay.mesh}
        if set(plan.layouts) == set(graph.by_name) and max(meshes) < cfg.cluster.n_devices:
            return plan
    configs = {
        role: (AutoConfig.from_pretrained(path, local_files_only=True), cfg.models[role].value_head)
        for role, path in model_dirs.items()
    }
    n = cfg.cluster.n_devices
    threads = max(1, int((cfg.cluster.num_cpus or os.cpu_count() or 1) / n))
    specs: dict[str, ModelSpec] = {}
    profiles: dict[ModelSpec, ModelProfile] = {}
    device_name = ""
    if searches(cfg.cluster) and cfg.cluster.device == "cuda":
        measured = gpu_profiles(configs)
        if measured is None:
            print(
                "rayhf: plan: auto keeps the colocated plan: no GPU visible here to time the "
                "models on",
                file=sys.stderr,
                flush=True,
            )
        else:
            specs, profiles, device_name = measured
    elif searches(cfg.cluster):
        specs, profiles = profiles_for(configs, threads)
    specs = {r: with_lora(s, cfg.models[r].lora, f"models.{r}.lora") for r, s in specs.items()}
    works = planner_workloads(cfg, graph, dataset)
    driver = cfg.driver
    devices = RunDevices(
        cfg.cluster, device_name, driver.moves_through_shm, driver.moves_through_ipc
    )
    cost = run_cost(devices, profiles)
    if cost is None:
        plan = colocated_for_run(graph, n)
    else:
        plan = plan_for_run(Problem(graph, specs, works, cost, step_options(cfg)), cfg.seed)
    saved.write_text(plan.to_json())
    return plan
