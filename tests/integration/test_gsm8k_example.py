"""examples/gsm8k_grpo.yaml end to end on generated GSM8K-format data: a BPE tokenizer trained
here, a small Qwen3 instruct model made by the SFT stage (Ray Train), then GRPO on chat prompts
with the exact-answer reward reading each row's ``answer`` column. The reward must rise clearly.
(What examples/gsm8k/run.sh does, in a temporary directory.)"""

from __future__ import annotations

import pytest
from example_support import gain, sft_then_rl

from rayhf.tasks.arithmetic import build_tokenizer

# 4.6 min alone on 2 cores; twice that when the machine is shared
pytestmark = [pytest.mark.ray, pytest.mark.timeout(1500)]


def test_gsm8k_grpo_raises_the_exact_answer_reward(ray_cluster, tmp_path):
    rl = {
        "dataset.path": str(tmp_path / "train.parquet"),
        "dataset.eval_path": str(tmp_path / "test.parquet"),
    }
    stages = ("gsm8k/sft.yaml", "gsm8k_grpo.yaml")
    metrics = sft_then_rl(ray_cluster, tmp_path, stages, build_tokenizer, rl)
    diff, se, told = gain([m["task_reward"] for m in metrics if m["step"] > 0])
    assert diff > 5 * se, f"exact-match reward {told}"
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [0, 50, 100]
    assert all(m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@8"] for m in evals)
