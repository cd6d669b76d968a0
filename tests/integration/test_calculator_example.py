"""examples/calculator end to end: a tokenizer made here, a small Qwen2 taught the calculator's
tool format by SFT (Ray Train), then multi-turn GRPO through ``CalculatorEnv``, whose reward only
a right answer that a calculator result showed earns (its degenerate answers score 0:
tests/unit/envs/test_agent.py). The reward must rise by at least 5 standard errors, with the
trainer's log-probs of the model's tokens the generator's. (What examples/calculator/run.sh
does, in a temporary directory.)"""

from __future__ import annotations

import statistics

import pytest
from conftest import REPO

import rayhf
from rayhf.runtime.train_stage import run_train_stage
from rayhf.runtime.trainer import run
from rayhf.tasks.calculator import build_tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200)]


def test_calculator_grpo_learns_to_use_the_tool(ray_cluster, tmp_path):
    common = {"cluster.address": ray_cluster, "metrics.console": False, "metrics.plot": False,
              "metrics.ray_metrics": False}  # fmt: skip
    build_tokenizer(tmp_path / "tokenizer")
    sft = rayhf.load_config(REPO / "examples" / "calculator" / "sft.yaml").with_overrides(
        {
            **common,
            "run_dir": str(tmp_path / "sft"),
            "tokenizer.path": str(tmp_path / "tokenizer"),
            "dataset.path": str(tmp_path / "sft.parquet"),
        }
    )
    policy = run_train_stage(sft).policy_checkpoint
    assert policy is not None
    grpo = rayhf.load_config(REPO / "examples" / "calculator" / "grpo.yaml").with_overrides(
        {
            **common,
            "run_dir": str(tmp_path / "grpo"),
            "models.actor.path": str(policy),
            "dataset.path": str(tmp_path / "train.parquet"),
        }
    )
    metrics = [m for m in run(grpo).metrics if m["step"] > 0]
    rewards = [m["task_reward"] for m in metrics]
    first, last = rewards[:10], rewards[-10:]
    se = (statistics.variance(first) / 10 + statistics.variance(last) / 10) ** 0.5
    gain = statistics.mean(last) - statistics.mean(first)
    told = f"{statistics.mean(first):.3f} -> {statistics.mean(last):.3f}: {gain / se:.1f} SE"
    assert gain > 5 * se, f"calculator reward {told}"
    for m in metrics:  # the SFT policy calls, then answers: two turns, one call
        assert m["logprob_mismatch"] < 1e-3 and m["tool_calls"] > 0.8
        assert m["ended_error"] == m["ended_timeout"] == 0.0
