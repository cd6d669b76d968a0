"""Step metrics fan out to sinks: console line, JSONL file, progress bar, Ray metrics, and the
experiment trackers of ``rayhf.metrics.sinks`` (TensorBoard, wandb, MLflow).

Each sink takes ``(step, metrics)``; a run owns one ``Tracker``. On resume the JSONL file is
cut back to the checkpoint's step first, so the file holds each step once.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from rayhf.errors import RayhfError
from rayhf.metrics.sinks import MlflowConfig, MlflowSink, TensorBoardSink, WandbConfig, WandbSink

METRICS_FILE = "metrics.jsonl"


class MetricsConfig(BaseModel):
    """Where step metrics go."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    jsonl: bool = True
    """Metrics.jsonl in the run directory."""
    ray_metrics: bool = True
    """Ray.util.metrics gauges for the dashboard."""
    plot: bool = True
    """Reward and KL against step, PNG, at the end."""
    console: bool = True
    """One line per step."""
    progress: bool | None = None
    """Progress bar; None = when stdout is a terminal."""
    tensorboard: bool = False
    """TensorBoard event files in <run_dir>/tensorboard."""
    wandb: WandbConfig | None = None
    """A Weights & Biases run (offline unless wandb.mode: online)."""
    mlflow: MlflowConfig | None = None
    """An MLflow run (a file store in <run_dir>/mlruns unless mlflow.tracking_uri)."""


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


# console line: (metric key, label, format)
CONSOLE_FIELDS = [
    ("task_reward", "reward", ".3f"),
    ("kl", "kl", ".4f"),
    ("policy_loss", "pg_loss", ".4f"),
    ("value_loss", "v_loss", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("greedy_reward", "greedy", ".3f"),
    ("dpo_loss", "dpo_loss", ".4f"),
    ("reward_margin", "margin", ".3f"),
    ("rm_loss", "rm_loss", ".4f"),
    ("accuracy", "acc", ".3f"),
    ("nll", "nll", ".4f"),
    ("response_len", "len", ".1f"),
    ("tokens_per_s", "tok/s", ".0f"),
    ("step_seconds", "s", ".2f"),
]


def console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    parts += [f"{label} {metrics[k]:{fmt}}" for k, label, fmt in CONSOLE_FIELDS if k in metrics]
    parts += [f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/")]
    calls = [
        f"{k.removeprefix('seconds/')} {v:.2f}s"
        for k, v in metrics.items()
        if k.startswith("seconds/")
    ]
    return "  ".join(parts) + ("  | " + " ".join(calls) if calls else "")


class ConsoleSink:
    def __init__(self, total: int, write=print) -> None:
        self.total, self.write = total, write

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.write(console_line(step, self.total, metrics))

    def close(self) -> None:
        pass


class JsonlSink:
    """Appends one JSON object per step; ``truncate_after`` drops rows of steps not kept."""

    def __init__(self, path: Path, truncate_after: int | None = None) -> None:
        self.path = path
        if truncate_after is not None and path.exists():
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            kept = [r for r in rows if r.get("step", 0) <= truncate_after]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)
        self.file = path.open("a")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class ProgressSink:
    def __init__(self, total: int, start: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if step == 0:  # the baseline evaluation before the first step
            return
        reward = metrics.get("task_reward")
        if reward is not None:
            self.bar.set_postfix(reward=f"{reward:.3f}")
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


# Per-call metrics exported as one Ray metric tagged by call (and role): the Grafana dashboard
# in deployments/grafana/ groups them by those tags.
TAGGED = {"seconds": "call_seconds", "realloc_seconds": "realloc_seconds",
          "realloc_bytes": "realloc_bytes"}  # fmt: skip


class RayMetricsSink:
    """A ``ray.util.metrics.Gauge`` per metric, tagged with the run name (for the dashboard);
    ``seconds/<call>``, ``realloc_seconds/<call>`` and ``realloc_bytes/<call>`` become
    ``rayhf_call_seconds``, ``rayhf_realloc_seconds`` and ``rayhf_realloc_bytes`` tagged with
    the call and its role (``roles``: call -> role); an untagged metric of one of those names
    (the step's total ``realloc_seconds``) becomes ``<name>_total``, since one Ray metric has
    one set of tag keys."""

    def __init__(self, run: str, roles: dict[str, str] | None = None) -> None:
        self.run, self.roles = run, roles or {}
        self.gauges: dict[str, Any] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in {"step": float(step), **metrics}.items():
            head, _, call = key.partition("/")
            if call and head in TAGGED:
                role = self.roles.get(call, call.removesuffix("_ema"))  # ``<role>_ema`` moves
                name, tags = TAGGED[head], {"run": self.run, "call": call, "role": role}
            else:
                name, tags = re.sub(r"[^a-zA-Z0-9_]", "_", key), {"run": self.run}
                name += "_total" if name in TAGGED.values() else ""
            self._gauge("rayhf_" + name, tuple(tags)).set(float(value), tags=tags)

    def _gauge(self, name: str, tag_keys: tuple[str, ...]) -> Any:
        from ray.util.metrics import Gauge

        if name not in self.gauges:
            self.gauges[name] = Gauge(name, description=f"rayhf {name}", tag_keys=tag_keys)
        return self.gauges[name]

    def close(self) -> None:
        pass


class Tracker:
    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for sink in self.sinks:
            sink.log(step, metrics)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def make_tracker(
    cfg: MetricsConfig, run_dir: Path, run_name: str, total: int, start: int,
    roles: dict[str, str] | None = None,
) -> Tracker:  # fmt: skip
    """The sinks ``cfg`` asks for; ``start``: the last step done (a resumed or recovered run:
    rows of later steps, from an attempt that failed, are dropped); ``roles``: call -> role
    (tags of the per-call Ray metrics)."""
    sinks: list[Sink] = []
    show_bar = cfg.progress if cfg.progress is not None else sys.stdout.isatty()
    if cfg.console:
        sinks.append(ConsoleSink(total, write=_bar_safe_print if show_bar else print))
    if cfg.jsonl:
        sinks.append(JsonlSink(run_dir / METRICS_FILE, truncate_after=start if start else -1))
    if show_bar:
        sinks.append(ProgressSink(total, start))
    if cfg.ray_metrics:
        sinks.append(RayMetricsSink(run_name, roles))
    check_trackers(cfg)
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir, start))
    if cfg.wandb is not None:
        sinks.append(WandbSink(cfg.wandb, run_dir, run_name))
    if cfg.mlflow is not None:
        sinks.append(MlflowSink(cfg.mlflow, run_dir, run_name))
    return Tracker(sinks)


def check_trackers(cfg: MetricsConfig) -> None:
    """Every experiment tracker ``cfg`` asks for is installed (a one-line error if not)."""
    import importlib.util

    wanted = {"tensorboard": cfg.tensorboard, "wandb": cfg.wandb is not None,
              "mlflow": cfg.mlflow is not None}  # fmt: skip
    for name, on in wanted.items():
        if on and importlib.util.find_spec(name) is None:
            raise RayhfError(
                f"metrics.{name}: {name} is not installed; pip install 'rayhf[tracking]' or "
                f"turn metrics.{name} off"
            )


def _bar_safe_print(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
