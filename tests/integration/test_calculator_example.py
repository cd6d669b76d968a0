"""examples/calculator end to end: a tokenizer made here, a small Qwen2 taught the calculator's
tool format by SFT (Ray Train), then multi-turn GRPO through ``CalculatorEnv``, whose reward only
a right answer that a calculator result showed earns (its degenerate answers score 0:
tests/unit/envs/test_agent.py). The reward must rise by at least 5 standard errors, with the
trainer's log-probs of the model's tokens the generator's. (What examples/calculator/run.sh
does, in a temporary directory, for 40 of its 60 GRPO steps: by step 40 the recorded run
had risen from 0.036 to 0.262 a step, docs/benchmarks/calculator_example.md.)"""

from __future__ import annotations

import pytest
from example_support import gain, sft_then_rl

from rayhf.tasks.calculator import build_tokenizer

pytestmark = [pytest.mark.ray, pytest.mark.timeout(1200)]


def test_calculator_grpo_learns_to_use_the_tool(ray_cluster, tmp_path):
    stages = ("calculator/sft.yaml", "calculator/grpo.yaml")
    rl = {"dataset.path": str(tmp_path / "train.parquet"), "steps": 40, "save_every": 40}
    metrics = sft_then_rl(ray_cluster, tmp_path, stages, build_tokenizer, rl)
    rows = [m for m in metrics if m["step"] > 0]
    diff, se, told = gain([m["task_reward"] for m in rows])
    assert diff > 5 * se, f"calculator reward {told}"
    calls = [m["tool_calls"] for m in rows]
    assert sum(calls) / len(calls) > 0.8, "the SFT policy calls the calculator, then answers"
    for m in rows:
        assert m["logprob_mismatch"] < 1e-3 and m["ended_error"] == m["ended_timeout"] == 0.0
