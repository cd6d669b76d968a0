"""One training run from config to checkpoint.

    config -> assets (files, graph, plan, dataset; no Ray yet) -> Session (Ray, role groups)
           -> per step: dataset rows -> executor.submit (step i+1 while step i runs, with
              driver.overlap_steps; with max_staleness k, the generation of step i+k before the
              rest of step i; with dynamic sampling, rounds of generation until the batch
              is full: runtime.refill) -> collect -> metrics -> eval and checkpoint on schedule
              (those steps drain: nothing runs past them)
           -> final checkpoint, plot, teardown

A resumed run reads the config written into the run directory, loads the newest complete
checkpoint (models, optimizer and interface state, dataset cursor) and continues its steps.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import ray

from rayhf.config import ExperimentConfig, dump_config, load_config
from rayhf.config.experiment import parse_override
from rayhf.config.registry import INTERFACES
from rayhf.data.batch import PackedBatch
from rayhf.data.datasets import to_packed
from rayhf.errors import RayhfError, RunFailed, RunInterrupted, RunPreempted
from rayhf.graph import Graph
from rayhf.metrics import make_tracker, plot_run, read_metrics
from rayhf.metrics.trace import TRACE_FILE, TraceSpan, TraceWriter
from rayhf.models.files import quiet_transformers
from rayhf.rewards.passk import pass_at_k_metrics
from rayhf.runtime.assets import RunAssets, prepare_run, refill_of
from rayhf.runtime.checkpoint import (
    list_checkpoints,
    read_state,
    usable_checkpoint,
    write_checkpoint,
)
from rayhf.runtime.driver import DagExecutor, StepOutcome, Submitted
from rayhf.runtime.preemption import Preemption
from rayhf.runtime.refill import RefillExecutor
from rayhf.runtime.session import Session
from rayhf.runtime.waits import gather

CONFIG_FILE = "config.yaml"


@dataclass
class RunResult:
    """What a finished run leaves behind."""

    run_dir: Path
    metrics: list[dict[str, float]]
    checkpoints: list[Path]
    plot: Path | None
    policy: str  # the graph's policy role (``Graph.policy_role``)
    info: dict[str, float] = field(default_factory=dict)

    @property
    def final_checkpoint(self) -> Path | None:
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def policy_checkpoint(self) -> Path | None:
        """The policy of the last checkpoint, in Hugging Face format (what serving loads)."""
        ckpt = self.final_checkpoint
        return ckpt / self.policy if ckpt is not None else None


def sample_means(batch: PackedBatch) -> dict[str, float]:
    """``batch/{key}``: the mean of every per-sample float key (e.g. a scoring call's scores)."""
    return {
        f"batch/{key}": t.float().mean().item()
        for key, t in batch.tensors.items()
        if t.is_floating_point() and t.numel() and all(n == 1 for n in batch.seqlens[key])
    }


def sequence_keys(graph: Graph) -> set[str]:
    """The graph keys holding the token sequences its train calls learn from (each interface
    names its own: ``Interface.sequence_keys``)."""
    out: set[str] = set()
    for c in graph.calls:
        if c.kind == "train":
            names = c.interface_inputs()
            out.update(names[k] for k in INTERFACES[c.interface].sequence_keys if k in names)
    return out


def step_metrics(
    outcome: StepOutcome, seconds: float, token_keys: Collection[str]
) -> dict[str, float]:
    """The train stats plus timing (per call, the step, and the driver/Ray overhead) and each
    call's peak memory; ``token_keys``: the sequences tokens/s counts."""
    metrics = dict(outcome.stats)
    for name, s in outcome.compute_seconds.items():
        metrics[f"seconds/{name}"] = s
    for name, peak in outcome.peak_bytes.items():
        metrics[f"peak_memory_gb/{name}"] = peak / 2**30
    compute = sum(outcome.compute_seconds.values())
    for name, moved in outcome.reallocs.items():
        metrics[f"realloc_seconds/{name}"] = moved.seconds
        metrics[f"realloc_bytes/{name}"] = float(moved.bytes)
    realloc = sum(m.seconds for m in outcome.reallocs.values())
    if outcome.reallocs:
        metrics["realloc_seconds"] = realloc
    metrics["step_seconds"] = seconds
    metrics["overhead_seconds"] = max(seconds - compute - realloc, 0.0)
    metrics.update(sample_means(outcome.batch))
    lens = outcome.batch.seqlens
    tokens = sum(sum(lens[k]) for k in sorted(token_keys) if k in lens)
    metrics["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return metrics


# what ``--resume DIR key=value`` may change: how long the run goes on and what it reports,
# never what a step computes (a prefix ending in "." covers the section)
SAFE_ON_RESUME = ("steps", "save_every", "eval_every", "eval_samples", "metrics.",
                  "fault_tolerance.max_restarts")  # fmt: skip


def _resumed_with(saved: ExperimentConfig, run_dir: Path, overrides: list[str]) -> ExperimentConfig:
    """The saved config with ``overrides`` that are safe to change on resume (saved back, so a
    later resume keeps them); any other key is refused in one line."""
    for item in overrides:
        key = parse_override(item)[0]
        if not any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_ON_RESUME):
            allowed = ", ".join(s + ("*" if s.endswith(".") else "") for s in SAFE_ON_RESUME)
            raise RayhfError(
                f"--resume {run_dir}: {key} cannot change on resume (the saved run computes with "
                f"it); these can: {allowed}"
            )
    cfg = saved.with_overrides(overrides)
    dump_config(cfg, run_dir / CONFIG_FILE)
    return cfg


def _open_run(
    cfg: ExperimentConfig | None, resume: str | Path | None, overrides: list[str] | None = None
):
    """(config, run_dir, checkpoint to resume from or None). A run directory is continued with
    ``--resume DIR`` (``overrides``: safe changes to its saved config), or by a config with
    ``resume: auto`` that names it."""
    if resume is None:
        assert cfg is not None
        run_dir = cfg.resolved_run_dir()
        if not list_checkpoints(run_dir):
            return cfg, run_dir, None
        if cfg.resume != "auto":
            raise RayhfError(
                f"run_dir {run_dir} already holds a run; continue it with --resume {run_dir} "
                f"(or resume: auto), or set run_dir (or name) to a new directory"
            )
        resume = run_dir
    run_dir = Path(resume)
    if not (run_dir / CONFIG_FILE).is_file():
        raise RayhfError(f"--resume {run_dir}: not a run directory (no {CONFIG_FILE})")
    saved = load_config(run_dir / CONFIG_FILE)
    ckpt = usable_checkpoint(run_dir, _say)
    if ckpt is None:
        raise RayhfError(f"--resume {run_dir}: no complete checkpoint to resume from")
    if overrides:
        saved = _resumed_with(saved, run_dir, overrides)
    return saved, run_dir, ckpt


def interrupted(run_dir: Path) -> RunInterrupted:
    """What Ctrl-C ends a run with: how to go on from where it stopped."""
    if not list_checkpoints(run_dir):  # names only: no checksums of GBs on the way out
        return RunInterrupted("interrupted before the first checkpoint; run the same command again")
    return RunInterrupted(
        f"interrupted; continue from the last checkpoint: rayhf run --resume {run_dir}"
    )


class RunLoop:
    """Owns the step loop of one run."""

    def __init__(self, cfg: ExperimentConfig, assets: RunAssets, session: Session) -> None:
        self.cfg, self.assets, self.session = cfg, assets, session
        driver = cfg.driver
        compiled = driver.compiled(cfg.cluster.device)
        self.executor: DagExecutor | RefillExecutor
        refill = refill_of(cfg)
        if refill is not None:
            self.executor = RefillExecutor(
                assets.graph, session.placement(), driver.call_timeout_s, cfg.batch_size,
                refill,
                lambda n: to_packed(assets.dataset.next_batch(n, cfg.seed)),
                len(assets.dataset),  # a step that draws as many rows without filling stops
            )  # fmt: skip
        else:
            self.executor = DagExecutor(
                assets.graph, session.placement(), compiled, driver.call_timeout_s,
                overlap=driver.overlap_steps,
                staleness=getattr(cfg.algorithm, "max_staleness", 0),
            )  # fmt: skip
        self.token_keys = sequence_keys(assets.graph)

    def checkpoint(self, step: int) -> Path:
        groups = self.session.groups
        self.executor.close()  # the actors take plain calls again

        def fill(tmp: Path) -> None:
            tmp = tmp.resolve()  # actors may run in another working directory
            optim = str(tmp / "optim")
            calls = [
                g.pending(rank, a.save.remote(str(tmp / g.role), optim, step), "checkpoint write")
                for g in (groups[role] for role in sorted(self.assets.trainable))
                for rank, a in enumerate(g.actors)
            ]
            gather(calls, self.session.timeout_s)

        return write_checkpoint(
            self.assets.run_dir, step, fill, {"dataset": self.assets.dataset.state_dict()}
        )

    def evaluate(self, step: int, trace: TraceWriter) -> dict[str, float]:
        """The graph on the whole held-out set (``eval_samples`` copies of each row), train
        calls reporting instead of updating; pass@k and the mean score where it scores."""
        assert self.assets.eval_dataset is not None
        copies = self.cfg.eval_samples
        samples = [
            dataclasses.replace(s, sample_id=s.sample_id * copies + j)
            for s in self.assets.eval_dataset.all_samples()
            for j in range(copies)
        ]
        outcome = self.executor.run_step(step, to_packed(samples), evaluate=True)
        trace.write(step, outcome.spans, "eval")
        stats = dict(outcome.stats)
        stats.update(pass_at_k_metrics(outcome.batch, copies, self.cfg.eval_correct_at))
        return {f"eval/{k}": v for k, v in stats.items()}

    def evaluates(self, step: int) -> bool:
        """Whether ``step`` ends with the held-out evaluation."""
        cfg = self.cfg
        return bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == cfg.steps)

    def saves(self, step: int) -> bool:
        """Whether ``step`` ends with a checkpoint."""
        cfg = self.cfg
        return step == cfg.steps or bool(cfg.save_every and step % cfg.save_every == 0)

    def drains(self, step: int) -> bool:
        """Whether nothing may run past ``step``: it evaluates, checkpoints or ends the run."""
        return self.evaluates(step) or self.saves(step)

    @property
    def overlaps(self) -> bool:
        """Whether a step is submitted before the previous one is collected."""
        return self.executor.overlap or self.executor.staleness > 0

    def _ahead_until(self, step: int) -> int:
        """The last step whose leading part may go out before ``step``'s rest: up to
        ``max_staleness`` ahead, never past a step that drains (its checkpoint and eval see
        nothing of later steps: the dataset cursor included)."""
        until = min(step + self.executor.staleness, self.cfg.steps)
        return next((d for d in range(step, until) if self.drains(d)), until)

    def finish(self, done: Submitted, since: float, trace: TraceWriter) -> dict[str, float]:
        """Collect a submitted step: its metrics (its seconds run from ``since``: its submission,
        or the previous step's end when it overlapped that one), trace, eval and checkpoint."""
        step = done.step
        outcome = self.executor.collect(done)
        metrics = step_metrics(outcome, time.perf_counter() - since, self.token_keys)
        trace.write(step, outcome.spans)
        if self.evaluates(step):
            metrics.update(self.evaluate(step, trace))
        if self.saves(step):
            self.checkpoint(step)
        return metrics

    def loop(self, start: int, recovered: Recovery | None = None) -> None:
        """Steps ``start + 1 ..``; ``recovered``: the recovery this attempt follows (its metrics
        go in the first step's row, its span in the trace). SIGTERM stops it at a step boundary
        with a checkpoint (``RunPreempted``)."""
        cfg = self.cfg
        roles = {c.name: c.role for c in self.assets.graph.calls}
        tracker = make_tracker(
            cfg.metrics, self.assets.run_dir, cfg.name, cfg.steps, start, roles
        )  # fmt: skip
        trace = TraceWriter(self.assets.run_dir / TRACE_FILE)
        began = time.time()
        extra = recovered.metrics() if recovered is not None else {}
        if recovered is not None:
            trace.write(start, [recovered.span()], "recovery")
        running: deque[tuple[Submitted, float]] = deque()  # (step, when it was submitted)
        last, ended = start, 0.0
        batches: dict[int, PackedBatch] = {}  # a step's rows, from its leading part to the rest
        ahead = start + 1  # the next step whose leading part (generation) goes out

        def collect() -> None:
            nonlocal extra, last, ended
            done, submitted = running.popleft()
            metrics = self.finish(done, max(submitted, ended), trace)
            tracker.log(done.step, {**metrics, **extra})
            extra, last, ended = {}, done.step, time.perf_counter()

        try:
            with Preemption(cfg.fault_tolerance.preempt_grace_s) as preemption:
                if cfg.eval_every and start == 0:
                    tracker.log(0, self.evaluate(0, trace))  # the held-out baseline
                for step in range(start + 1, cfg.steps + 1):
                    stopping = preemption.requested  # read once: SIGTERM may come at any time
                    if stopping and step >= ahead:
                        break  # every step whose generation went out is finished first
                    while ahead <= self._ahead_until(step) and not stopping:
                        rows = self.assets.dataset.next_batch(cfg.batch_size, cfg.seed)
                        batches[ahead] = to_packed(rows)
                        self.executor.submit(ahead, batches[ahead], part="lead")
                        ahead += 1
                    submitted = self.executor.submit(step, batches.pop(step))
                    running.append((submitted, time.perf_counter()))
                    keep = 1 if self.overlaps and not self.drains(step) else 0
                    while len(running) > (0 if preemption.requested else keep):
                        collect()
                while running:  # a SIGTERM's break can leave a step in flight: finish it first
                    collect()
                if preemption.requested and last < cfg.steps:
                    self._preempted(last)
        except KeyboardInterrupt:
            raise interrupted(self.assets.run_dir) from None
        finally:
            self.executor.close()
            tracker.close()
            _add_ray_timeline(trace, began)
            trace.close()

    def _preempted(self, step: int) -> None:
        """SIGTERM came: checkpoint ``step`` (the last one done) unless it just was, then stop."""
        if not self.saves(step):
            self.checkpoint(step)
        raise RunPreempted(
            f"stopped by SIGTERM after step {step}, checkpoint written; continue with "
            f"rayhf run --resume {self.assets.run_dir} (or resume: auto in the config)"
        )


@dataclass(frozen=True)
class Recovery:
    """One recovery: what failed, when, and the step the run continues after."""

    count: int  # 1 for the first recovery of the run
    reason: str
    failed_at: float  # time.time() when the failure was found
    restarted_at: float  # time.time() when the role groups were up again
    from_step: int

    def metrics(self) -> dict[str, float]:
        return {
            "recovery/count": float(self.count),
            "recovery/seconds": self.restarted_at - self.failed_at,
        }

    def span(self) -> TraceSpan:
        args = {"count": self.count, "reason": self.reason, "from_step": self.from_step}
        return TraceSpan(
            "recovery", "recovery", "", "", "recovery", self.failed_at, self.restarted_at, args
        )


def _add_ray_timeline(trace: TraceWriter, since: float) -> None:
    """Ray's task events of this run into the trace (best effort: Ray may be failing)."""
    state_logger = logging.getLogger("ray._private.state")
    level = state_logger.level
    state_logger.setLevel(logging.ERROR)  # ray.timeline() warns about a future change
    try:
        trace.write_ray_events(ray.timeline(), since)
    except Exception:  # the run's own trace is already written
        pass
    finally:
        state_logger.setLevel(level)


def run(
    cfg: ExperimentConfig | None = None,
    resume: str | Path | None = None,
    overrides: list[str] | None = None,
) -> RunResult:
    """Run (or with ``resume``, continue) an experiment to its last step, recovering from
    failures by itself (``fault_tolerance.max_restarts``). ``overrides`` (with ``resume``):
    ``key=value`` changes to the saved config that are safe on resume (``SAFE_ON_RESUME``)."""
    quiet_transformers()
    if overrides and resume is None:
        raise RayhfError("overrides without resume: give them to load_config")
    cfg, run_dir, ckpt = _open_run(cfg, resume, overrides)
    assets = prepare_run(cfg, run_dir)
    if ckpt is None:
        dump_config(cfg, run_dir / CONFIG_FILE)
    try:
        info = _attempts(cfg, assets, ckpt)
    except KeyboardInterrupt:  # outside the step loop: starting, recovering, tearing down
        raise interrupted(run_dir) from None
    rows = read_metrics(run_dir)
    plot = plot_run(rows, run_dir / "reward_kl.png", cfg.name) if cfg.metrics.plot else None
    policy = assets.graph.policy_role
    return RunResult(run_dir, rows, list_checkpoints(run_dir), plot, policy, info)


def _attempts(cfg: ExperimentConfig, assets: RunAssets, ckpt: Path | None) -> dict[str, float]:
    """Run from ``ckpt`` (None: the start); after a recoverable failure, up to ``max_restarts``
    times: tear everything down, wait for the devices, restore the newest usable checkpoint
    (models, optimizers, interface state, dataset cursor; sampling is seeded by step) and go
    on. Returns the run's info (start step, initial reallocation, recoveries)."""
    ft, run_dir = cfg.fault_tolerance, assets.run_dir
    fresh = assets.dataset.state_dict()  # where a run with no checkpoint yet starts again
    info: dict[str, float] = {}
    recovered: Recovery | None = None
    while True:
        start = _restore(assets, ckpt, fresh)
        info.setdefault("start_step", float(start))
        if start >= cfg.steps:
            return info
        count = recovered.count if recovered else 0
        inject = ft.fault_of_attempt(count)
        wait_s = ft.resources_timeout_s if count else None
        try:
            with Session(cfg, assets, ckpt, inject, wait_s) as session:
                if session.init_realloc is not None:
                    info["init_realloc_seconds"] = session.init_realloc.seconds
                    info["init_realloc_bytes"] = float(session.init_realloc.bytes)
                if recovered is not None:
                    recovered = dataclasses.replace(recovered, restarted_at=time.time())
                RunLoop(cfg, assets, session).loop(start, recovered)
            return info
        except RunFailed as e:
            if not e.recoverable or count >= ft.max_restarts:
                how = f"rayhf run --resume {run_dir}"
                raise RunFailed(f"{e}; continue from the last checkpoint: {how}", False) from e
            ckpt = usable_checkpoint(run_dir, _say)
            step = int(read_state(ckpt)["step"]) if ckpt is not None else 0
            # its time runs from the failure: the teardown above counts as lost
            recovered = Recovery(count + 1, str(e), e.at, time.time(), step)
            info["recoveries"] = float(count + 1)
            _say(f"recovering ({count + 1} of {ft.max_restarts}) from: {e}; continuing after "
                 f"step {step}")  # fmt: skip


def _restore(assets: RunAssets, ckpt: Path | None, fresh: dict) -> int:
    """Put the dataset cursor where ``ckpt`` left it (None: ``fresh``); the step it ends."""
    if ckpt is None:
        assets.dataset.load_state_dict(fresh)
        return 0
    state = read_state(ckpt)
    assets.dataset.load_state_dict(state["dataset"])
    return int(state["step"])


def _say(line: str) -> None:
    """One line to stderr, as the CLI reports (``rayhf: ...``)."""
    print(f"rayhf: {line}", file=sys.stderr, flush=True)
