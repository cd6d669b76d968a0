"""examples/gsm8k_grpo.yaml end to end on generated GSM8K-format data: a BPE tokenizer trained
here, a small Qwen3 instruct model made by the SFT stage (Ray Train), then GRPO on chat prompts
with the exact-answer reward reading each row's ``answer`` column. The reward must rise clearly.
(What examples/gsm8k/run.sh does, in a temporary directory.)"""

from __future__ import annotations

import statistics

import pytest
from conftest import REPO

import rayhf
from rayhf.runtime.train_stage import run_train_stage
from rayhf.runtime.trainer import run
from rayhf.tasks.arithmetic import build_tokenizer

# 4.6 min alone on 2 cores; twice that when the machine is shared
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1500)]


def test_gsm8k_grpo_raises_the_exact_answer_reward(ray_cluster, tmp_path):
    common = {"cluster.address": ray_cluster, "metrics.console": False, "metrics.plot": False,
              "metrics.ray_metrics": False}  # fmt: skip
    build_tokenizer(tmp_path / "tokenizer")
    sft = rayhf.load_config(REPO / "examples" / "gsm8k" / "sft.yaml").with_overrides(
        {
            **common,
            "run_dir": str(tmp_path / "sft"),
            "tokenizer.path": str(tmp_path / "tokenizer"),
            "dataset.path": str(tmp_path / "sft.parquet"),
        }
    )
    instruct = run_train_stage(sft).policy_checkpoint
    assert instruct is not None and (instruct / "tokenizer_config.json").is_file()
    grpo = rayhf.load_config(REPO / "examples" / "gsm8k_grpo.yaml").with_overrides(
        {
            **common,
            "run_dir": str(tmp_path / "grpo"),
            "models.actor.path": str(instruct),
            "dataset.path": str(tmp_path / "train.parquet"),
            "dataset.eval_path": str(tmp_path / "test.parquet"),
        }
    )
    metrics = run(grpo).metrics
    rewards = [m["task_reward"] for m in metrics if m["step"] > 0]
    first, last = rewards[:10], rewards[-10:]
    se = (statistics.variance(first) / 10 + statistics.variance(last) / 10) ** 0.5
    gain = statistics.mean(last) - statistics.mean(first)
    told = f"{statistics.mean(first):.3f} -> {statistics.mean(last):.3f}: {gain / se:.1f} SE"
    assert gain > 5 * se, f"exact-match reward {told}"
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 50, 100]
    assert all(m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@8"] for m in evals)
