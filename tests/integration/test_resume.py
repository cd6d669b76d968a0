"""A run killed with SIGKILL mid-run resumes from its last complete checkpoint and finishes, its
learning rates those of an uninterrupted run, its tracked runs (TensorBoard, wandb, MLflow)
continued."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides
from tracking_support import mlflow_runs, tensorboard_scalars, wandb_runs

import rayhf
from rayhf.engines.schedule import ScheduleConfig, rate
from rayhf.metrics.sinks import TRACKING_FILE
from rayhf.runtime.checkpoint import damage

pytestmark = pytest.mark.ray


def _cli(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "rayhf", *args]


def test_sigkill_then_resume(ray_cluster, tmp_path):
    run_dir = tmp_path / "run"
    schedule = {"kind": "cosine", "warmup_steps": 3}  # the rates must go on as they would have
    ov = tiny_overrides(run_dir, steps=12, save_every=3, **{"cluster.address": ray_cluster})
    ov.update({f"models.actor.optimizer.schedule.{k}": v for k, v in schedule.items()})
    # and every experiment tracker, whose resumed run must be the same run
    ov.update({"metrics.tensorboard": True, "metrics.wandb.project": "t",
               "metrics.mlflow.experiment": "t"})  # fmt: skip
    args = ["run", str(REPO / "examples" / "ppo_tiny.yaml")] + [f"{k}={v}" for k, v in ov.items()]
    proc = subprocess.Popen(_cli(args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first_ckpt = run_dir / "checkpoints" / "step_000003" / "state.json"
    deadline = time.time() + 240
    while not first_ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert first_ckpt.exists(), "the run never wrote its first checkpoint"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert "step_000012" not in done, "killed too late to test a resume"

    resumed = subprocess.run(
        _cli(["run", "--resume", str(run_dir)]), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13)), "each step logged exactly once"
    lr = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").models["actor"].optimizer.lr
    expected = [rate(ScheduleConfig(**schedule), lr, step, 12) for step in range(1, 13)]
    assert [r["lr/actor"] for r in rows] == pytest.approx(expected)
    rewards = [r["task_reward"] for r in rows]  # the resume's, after the killed attempt's
    assert [v for _, v in tensorboard_scalars(run_dir, "task_reward")] == pytest.approx(rewards)
    # wandb: the resume writes under the id the killed attempt chose (whose own offline records
    # the kill may lose: wandb's service process had not written them yet)
    wandb_id = json.loads((run_dir / TRACKING_FILE).read_text())["wandb"]
    resumed = wandb_runs(run_dir)[-1]
    assert resumed["id"] == wandb_id and resumed["history"][-1]["_step"] == 12
    (tracked,) = mlflow_runs(run_dir)
    assert tracked.data.metrics["task_reward"] == pytest.approx(rewards[-1])
    final = run_dir / "checkpoints" / "step_000012"
    assert json.loads((final / "state.json").read_text())["step"] == 12
    assert (final / "actor" / "config.json").is_file()
    assert (final / "optim" / "actor.rank0.pt").is_file()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def finished(ray_cluster, tmp_path_factory) -> Path:
    """A finished 2-step tiny run, checkpointed after steps 1 and 2: each test resumes a copy."""
    tmp = tmp_path_factory.mktemp("finished")
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml")
    return rayhf.run(cfg.with_overrides(tiny_overrides(tmp / "run", steps=2))).run_dir


def _copy(run_dir: Path, tmp: Path) -> Path:
    shutil.copytree(run_dir, tmp / "run")
    return tmp / "run"


def test_resume_of_a_finished_run_is_a_no_op_and_steps_extend_it(finished, tmp_path):
    """A finished run resumed as it is does nothing; resumed with ``steps=3`` it runs step 3
    and keeps the new length in its saved config; a key that changes what a step computes is
    refused in one line, before anything starts."""
    from rayhf.errors import RayhfError

    run_dir = _copy(finished, tmp_path)
    last = run_dir / "checkpoints" / "step_000002"
    again = rayhf.run(resume=str(run_dir))
    assert again.info["start_step"] == 2 and [m["step"] for m in again.metrics] == [1, 2]
    assert Path(again.checkpoints[-1]) == last
    with pytest.raises(RayhfError, match=r"algorithm\.kl_coef cannot change on resume") as refused:
        rayhf.run(resume=str(run_dir), overrides=["steps=3", "algorithm.kl_coef=0.5"])
    assert "\n" not in str(refused.value)
    longer = rayhf.run(resume=str(run_dir), overrides=["steps=3", "save_every=3"])
    assert longer.info["start_step"] == 2 and [m["step"] for m in longer.metrics] == [1, 2, 3]
    assert [c.name for c in longer.checkpoints][-1] == "step_000003"
    assert rayhf.load_config(run_dir / "config.yaml").steps == 3


def test_a_corrupted_checkpoint_is_skipped_in_one_line_for_the_previous_one(
    finished, tmp_path, capfd
):
    run_dir = _copy(finished, tmp_path)
    optim = run_dir / "checkpoints" / "step_000002" / "optim" / "actor.rank0.pt"
    whole = optim.stat().st_size
    optim.write_bytes(optim.read_bytes()[:-100])  # a disk that lost the file's end
    capfd.readouterr()
    again = rayhf.run(resume=str(run_dir))
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("rayhf:")]
    assert said == [
        "rayhf: checkpoint step_000002 is damaged (optim/actor.rank0.pt has "
        f"{whole - 100} bytes, the manifest says {whole}); "
        "using step_000001"
    ]
    assert again.info["start_step"] == 1 and [m["step"] for m in again.metrics] == [1, 2]
    assert damage(again.checkpoints[-1]) is None, "step 2 was written again, whole"
