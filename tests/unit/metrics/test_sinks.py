"""The experiment trackers (``rayhf.metrics.sinks``) read back: TensorBoard's event files,
wandb's offline run files and MLflow's file store hold each step's metrics, the run's config
and plan, and a resumed run continues the same tracked run."""

from __future__ import annotations

import json

import pytest
import yaml
from tracking_support import mlflow_runs, tensorboard_scalars, wandb_runs

from rayhf.errors import RayhfError
from rayhf.metrics.sinks import TRACKING_FILE
from rayhf.metrics.tracker import MetricsConfig, make_tracker

ALL = {"console": False, "jsonl": False, "ray_metrics": False, "progress": False,
       "tensorboard": True, "wandb": {}, "mlflow": {}}  # fmt: skip


def _attempt(run_dir, start: int, steps: range, scale: float) -> None:
    tracker = make_tracker(MetricsConfig.model_validate(ALL), run_dir, "calc", 4, start)
    for step in steps:
        tracker.log(step, {"task_reward": step * scale, "eval/pass@1": 0.5, "lr/actor": 1e-3})
    tracker.close()


def test_every_sink_reads_back_and_a_resume_continues_its_run(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"name": "calc", "steps": 4}))
    (tmp_path / "plan.json").write_text(json.dumps({"actor_gen": "dp2"}))
    _attempt(tmp_path, 0, range(1, 4), 1.0)  # steps 1-3, then it dies after its step-2 save
    _attempt(tmp_path, 2, range(3, 5), 10.0)  # the resume redoes step 3 and finishes
    ids = json.loads((tmp_path / TRACKING_FILE).read_text())
    # TensorBoard: the first attempt's step 3 is gone, the resumed one's kept
    assert tensorboard_scalars(tmp_path, "task_reward") == [(1, 1.0), (2, 2.0), (3, 30.0),
                                                            (4, 40.0)]  # fmt: skip
    # wandb: two offline pieces of one run id, the config with the plan
    first, second = wandb_runs(tmp_path)
    assert first["id"] == second["id"] == ids["wandb"]
    assert first["config"]["steps"] == 4 and "dp2" in first["config"]["plan"]
    steps = [h["_step"] for r in (first, second) for h in r["history"]]
    assert steps == [1, 2, 3, 3, 4] and second["history"][-1]["task_reward"] == 40.0
    # MLflow: one run, resumed, its params the config, config and plan kept as artifacts
    (run,) = mlflow_runs(tmp_path)
    assert run.info.run_id == ids["mlflow"] and run.data.params["steps"] == "4"
    assert run.data.metrics["task_reward"] == 40.0 and "eval/pass_1" in run.data.metrics


def test_a_tracker_that_is_not_installed_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m: None if m == "wandb" else real(m))
    with pytest.raises(RayhfError, match=r"metrics\.wandb: wandb is not installed"):
        make_tracker(MetricsConfig(jsonl=False, ray_metrics=False, wandb={}), tmp_path, "r", 1, 0)
