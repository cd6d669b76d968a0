"""Experiment-tracking sinks: TensorBoard, Weights & Biases and MLflow, beside the console, JSONL
and Ray-metrics ones (``rayhf.metrics.tracker``).

Each logs every step's metrics at their step, and once, when the run starts, its config
(``config.yaml`` of the run directory) and plan (``plan.json``, where the run has one). A resumed
run continues the same tracked run: the wandb and MLflow run ids are kept in the run directory
(``tracking.json``), and TensorBoard's writer drops the events a failed attempt wrote after the
step the run resumes from. (wandb and MLflow keep such steps: they show twice there.)

- TensorBoard: event files in ``<run_dir>/tensorboard`` (``torch.utils.tensorboard``).
- wandb: offline by default, files in ``<run_dir>/wandb`` for ``wandb sync``; online needs a
  login (``WANDB_API_KEY``).
- MLflow: a local file store in ``<run_dir>/mlruns`` unless ``tracking_uri`` names a server;
  metric names are MLflow's alphabet (``eval/pass@1`` is logged as ``eval/pass_1``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict

TRACKING_FILE = "tracking.json"  # the tracked runs' ids, for a resume to continue them


class WandbConfig(BaseModel):
    """A Weights & Biases run per rayhf run."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    project: str = "rayhf"
    """The wandb project."""
    entity: str | None = None
    """The wandb team or user; None: the login's default."""
    mode: Literal["offline", "online"] = "offline"
    """Offline: files in <run_dir>/wandb, uploaded later by `wandb sync`."""


class MlflowConfig(BaseModel):
    """An MLflow run per rayhf run."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    tracking_uri: str | None = None
    """An MLflow server or store; None: a file store in <run_dir>/mlruns."""
    experiment: str = "rayhf"
    """The MLflow experiment the run goes in."""


def _ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / TRACKING_FILE
    return dict(json.loads(path.read_text())) if path.exists() else {}


def _keep_id(run_dir: Path, sink: str, run_id: str) -> None:
    path = run_dir / TRACKING_FILE
    path.write_text(json.dumps({**_ids(run_dir), sink: run_id}, indent=1) + "\n")


def run_record(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    """The run's config (as its config.yaml holds it) and its plan file's text, if any."""
    cfg = run_dir / "config.yaml"
    plan = run_dir / "plan.json"
    config = yaml.safe_load(cfg.read_text()) if cfg.exists() else {}
    return config or {}, plan.read_text() if plan.exists() else None


class TensorBoardSink:
    def __init__(self, run_dir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resume drops what a failed attempt wrote after its checkpoint
        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=start + 1 if start else None
        )
        if start == 0:
            config, plan = run_record(run_dir)
            self.writer.add_text("config", _code(yaml.safe_dump(config, sort_keys=False)))
            if plan is not None:
                self.writer.add_text("plan", _code(plan))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())  # markdown: verbatim


class WandbSink:
    def __init__(self, cfg: WandbConfig, run_dir: Path, name: str) -> None:
        import wandb

        run_id = _ids(run_dir).get("wandb") or secrets.token_hex(4)
        _keep_id(run_dir, "wandb", run_id)
        config, plan = run_record(run_dir)
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=name, id=run_id, resume="allow",
            dir=str(run_dir), mode=cfg.mode, config={**config, "plan": plan},
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(self, cfg: MlflowConfig, run_dir: Path, name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = cfg.tracking_uri
        if uri is None:  # MLflow 3 keeps its file store only behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        run_id = _ids(run_dir).get("mlflow")
        if run_id is None:
            exp = self.client.get_experiment_by_name(cfg.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment)
            run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            _keep_id(run_dir, "mlflow", run_id)
            config, _ = run_record(run_dir)
            params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
            for lo in range(0, len(params), 100):  # MLflow takes 100 params a batch
                self.client.log_batch(run_id, params=params[lo : lo + 100])
            for path in (run_dir / "config.yaml", run_dir / "plan.json"):
                if path.exists():
                    self.client.log_artifact(run_id, str(path))
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_name(k), float(v), now, step) for k, v in metrics.items()]
        for lo in range(0, len(batch), 1000):  # MLflow takes 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=batch[lo : lo + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_name(key: str) -> str:
    return re.sub(r"[^\w\-. :/]", "_", key)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay whole)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return out
