"""Single-call training graphs (supervised fine-tuning, reward models) as Ray Train jobs.

config -> assets (files, dataset checks, initial weights)
       -> TorchTrainer: one worker per device, torch.distributed set up by Ray Train
          each step: the dataset's batch, this worker's token-balanced share
                     -> the call's interface.train_step (same interfaces as `rayhf run`)
                     -> ray.train.report(metrics, checkpoint on schedule)
       -> a UserCallback on the Train controller forwards every report to a queue that the
          driver drains into the run's tracker (console, metrics.jsonl, Ray metrics)
       -> the last reported checkpoint, copied to checkpoints/step_N/<role>/ (HF format)
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig, UserCallback
from ray.train.torch import TorchTrainer
from ray.util.queue import Empty, Queue

from rayhf.algorithms import CallContext, InterfaceSettings
from rayhf.config import ExperimentConfig, dump_config
from rayhf.config.registry import make_interface
from rayhf.data.datasets import DatasetKind, PromptDataset, kind_for_inputs, to_packed
from rayhf.engines.build import standalone_engine
from rayhf.engines.call import CallEngine
from rayhf.engines.schedule import step_to
from rayhf.errors import RayhfError
from rayhf.metrics import make_tracker, plot_run, read_metrics
from rayhf.models.files import quiet_transformers
from rayhf.models.hf import load_model
from rayhf.parallel.groups import build_groups
from rayhf.runtime.assets import RunAssets, prepare_run
from rayhf.runtime.checkpoint import list_checkpoints, write_checkpoint
from rayhf.runtime.cluster import DEVICE_RESOURCE, connect
from rayhf.runtime.trainer import CONFIG_FILE, RunResult


@dataclass(frozen=True)
class StageSpec:
    """What every Ray Train worker needs (the config travels as validated JSON)."""

    config: dict[str, Any]
    role: str
    interface: str
    model_dir: str
    value_head: bool
    threads: int
    kind: DatasetKind  # the dataset format the graph's inputs ask for


def absolute_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """Ray Train workers run in their own working directory: give them absolute paths."""
    ds = cfg.dataset
    paths: dict[str, str | Path | None] = {
        "graph": cfg.graph_path(),
        "dataset.path": ds.path,
        "dataset.eval_path": ds.eval_path,
    }
    return cfg.with_overrides({k: str(Path(v).resolve()) for k, v in paths.items() if v})


def _stage_call(assets: RunAssets) -> tuple[str, str]:
    calls = assets.graph.calls
    if len(calls) != 1 or calls[0].kind != "train":
        raise RayhfError(
            f"graph '{assets.graph.name}' has {len(calls)} calls; a Ray Train stage runs a graph "
            f"with exactly one train call; run other graphs with `rayhf run`"
        )
    return calls[0].role, calls[0].interface


def _evaluate(iface, engine, held_out, rank: int, world: int, step: int) -> dict[str, float]:
    shard = to_packed(held_out.all_samples()).split(world)[rank]
    stats = iface.evaluate(engine, shard, CallContext(step, rank, world, 0))
    return {f"eval/{k}": v for k, v in stats.items()}


def _save(engine: CallEngine, role: str) -> Checkpoint:
    out = Path(tempfile.mkdtemp(prefix="rayhf-ckpt-"))
    assert engine.model is not None
    engine.model.save_pretrained(out / role)
    return Checkpoint.from_directory(str(out))


def stage_worker(config: dict[str, Any]) -> None:
    """The per-worker loop; ``ray.train.report`` is called by every worker every step."""
    from transformers import AutoTokenizer

    spec: StageSpec = config["spec"]
    cfg = ExperimentConfig.model_validate(spec.config)
    quiet_transformers()
    _quiet_report_log()
    torch.set_num_threads(spec.threads)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(spec.model_dir, local_files_only=True)
    model = load_model(spec.model_dir, spec.value_head, f"models.{spec.role}")
    groups = build_groups(world, 1, 1, rank) if world > 1 else None  # data parallel only
    optim = cfg.models[spec.role].optimizer
    engine = standalone_engine(model, tokenizer, spec.value_head, optim, groups)
    iface = make_interface(spec.interface, InterfaceSettings(cfg.algorithm, cfg.generation))
    kind = spec.kind
    data = PromptDataset.from_config(cfg.dataset, tokenizer, kind)
    held_out = None
    if cfg.dataset.eval_path and cfg.eval_every:
        held_out = PromptDataset.from_config(cfg.dataset, tokenizer, kind, cfg.dataset.eval_path)
        ray.train.report({"step": 0, **_evaluate(iface, engine, held_out, rank, world, 0)})
    for step in range(1, cfg.steps + 1):
        begin = time.perf_counter()
        shard = to_packed(data.next_batch(cfg.batch_size, cfg.seed)).split(world)[rank]
        assert engine.trainer is not None
        total = optim.schedule.total_steps or cfg.steps
        lr = step_to(engine.trainer.optimizer, optim.schedule, optim.lr, step, total)
        stats = iface.train_step(engine, shard, CallContext(step, rank, world, cfg.seed))
        metrics = {"step": step, **stats, f"lr/{spec.role}": lr}
        metrics["step_seconds"] = time.perf_counter() - begin
        last = step == cfg.steps
        if held_out is not None and (last or step % cfg.eval_every == 0):
            metrics.update(_evaluate(iface, engine, held_out, rank, world, step))
        save = last or (cfg.save_every and step % cfg.save_every == 0)
        checkpoint = _save(engine, spec.role) if save and rank == 0 else None
        ray.train.report(metrics, checkpoint=checkpoint)


def _quiet_report_log() -> None:
    """Ray Train logs every report at INFO from every worker; the tracker already shows them."""
    with contextlib.suppress(ImportError, AttributeError):
        from ray.train.v2._internal.execution import context

        logging.getLogger(context.__file__).setLevel(logging.WARNING)


class QueueCallback(UserCallback):
    """Runs on the Train controller: forwards rank 0's metrics of every report to the driver."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self.queue.put(dict(metrics[0]))


def _drain(queue: Queue, tracker, done: threading.Event) -> None:
    while not (done.is_set() and queue.empty()):
        try:
            row = queue.get(timeout=0.2)
        except Empty:
            continue
        step = int(row.pop("step"))
        tracker.log(step, row)


def _scaling(cfg: ExperimentConfig) -> ScalingConfig:
    total = ray.cluster_resources()
    per_worker = {"CPU": max(total.get("CPU", 1) / cfg.cluster.n_devices, 0.25)}
    if cfg.cluster.device == "cpu":
        per_worker[DEVICE_RESOURCE] = 1.0
    use_gpu = cfg.cluster.device == "cuda"
    return ScalingConfig(
        num_workers=cfg.cluster.n_devices, use_gpu=use_gpu, resources_per_worker=per_worker
    )


def _fit(cfg: ExperimentConfig, assets: RunAssets, spec: StageSpec):
    queue = Queue(actor_options={"num_cpus": 0})
    tracker = make_tracker(cfg.metrics, assets.run_dir, cfg.name, cfg.steps, 0)
    done = threading.Event()
    drainer = threading.Thread(target=_drain, args=(queue, tracker, done), daemon=True)
    drainer.start()
    trainer = TorchTrainer(
        stage_worker,
        train_loop_config={"spec": spec},
        scaling_config=_scaling(cfg),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=str((assets.run_dir / "ray_train").resolve()),
            callbacks=[QueueCallback(queue)],  # type: ignore[list-item]  # v2 UserCallback
        ),
    )
    try:
        return trainer.fit()
    finally:
        done.set()
        drainer.join(timeout=30)
        tracker.close()
        queue.shutdown(force=True)


def run_train_stage(cfg: ExperimentConfig) -> RunResult:
    """Train ``cfg``'s single-call graph with Ray Train; returns metrics and checkpoints."""
    quiet_transformers()
    run_dir = cfg.resolved_run_dir()
    if list_checkpoints(run_dir):
        raise RayhfError(f"run_dir {run_dir} already holds a run; set run_dir (or name)")
    assets = prepare_run(cfg, run_dir)
    role, interface = _stage_call(assets)
    dump_config(cfg, run_dir / CONFIG_FILE)
    # Each ray.train.report waits for the controller's next poll (every 2 s by default), which
    # made a 0.05 s step take ~1.6 s here; at 0.2 s a 0.1 s step took 0.22 s, at 0.05 s 0.13 s
    # (the calculator example's first stage). The embedded cluster's processes inherit this.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.05")
    # Ray Train's controller watches itself through the state API, which the dashboard serves
    started = connect(cfg.cluster.model_copy(update={"dashboard": True}))
    threads = max(1, int(ray.cluster_resources().get("CPU", 1) // cfg.cluster.n_devices))
    spec = StageSpec(
        absolute_paths(cfg).model_dump(mode="json"), role, interface,
        str(assets.model_dirs[role].resolve()),
        cfg.models[role].value_head, threads, kind_for_inputs(assets.graph.inputs),
    )  # fmt: skip
    try:
        result = _fit(cfg, assets, spec)
    finally:
        if started:
            ray.shutdown()
    if result.checkpoint is not None:
        with result.checkpoint.as_directory() as src:
            write_checkpoint(run_dir, cfg.steps, lambda tmp: _copy_role(Path(src), tmp, role), {})
    rows = read_metrics(run_dir)
    plot = plot_run(rows, run_dir / "reward_kl.png", cfg.name) if cfg.metrics.plot else None
    return RunResult(run_dir, rows, list_checkpoints(run_dir), plot, role)


def _copy_role(src: Path, dst: Path, role: str) -> None:
    shutil.copytree(src / role, dst / role)
