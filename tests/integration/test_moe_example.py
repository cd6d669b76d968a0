"""examples/grpo_moe_tiny.yaml end to end: a Qwen3-MoE policy (8 experts, 2 a token) learns the
demo task in bf16 with GRPO, its generate and train calls and its reference each holding half
of every layer's experts (ep = 2, tokens exchanged between the two ranks; the generator's two
replicas decode in step), and every token of its training sent
to the experts its generator chose (routing replay, rows packed). The demo's degenerate answers
score at most 0.3 (tests/unit/tasks/test_demo.py), as on the dense demo. The reward must rise
by at least ``RISE`` standard errors of the first and last 10 steps' means: 0.068 -> 0.120 in
40 steps (6.2 SE) on this machine; under the auto plan (ep = 1, 120 steps) see
docs/benchmarks/router_replay.md."""

from __future__ import annotations

from pathlib import Path

import pytest
from example_support import QUIET, gain

import rayhf
from rayhf.runtime.trainer import run

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RISE = 5
STEPS = 40
PLAN = {
    "actor_gen": {"dp": 2, "ep": 2},
    "actor_train": {"dp": 2, "ep": 2},
    "ref_inf": {"dp": 2, "ep": 2},
    "rew_inf": {"dp": 2},
}


def test_a_mixture_of_experts_policy_learns_the_demo_with_its_routes_replayed(
    ray_cluster, tmp_path
):
    cfg = rayhf.load_config(REPO / "examples" / "grpo_moe_tiny.yaml").with_overrides(
        {
            **QUIET,
            "cluster.address": ray_cluster,
            "run_dir": str(tmp_path / "run"),
            "dataset.path": str(tmp_path / "echo.parquet"),
            "steps": STEPS,
            "save_every": STEPS,
            "models.actor.precision": "bf16",
            "plan": PLAN,
        }
    )
    rows = [m for m in run(cfg).metrics if m["step"] > 0]
    diff, se, told = gain([m["task_reward"] for m in rows])
    assert diff > RISE * se, f"MoE demo reward {told}"
    assert all(m["routes_differ"] == 0.0 for m in rows), "a token went to other experts"
    # in bf16 the trainer's router would have chosen other experts for some tokens
    assert max(m["routes_differ_own"] for m in rows) > 0
    assert all(1.0 < m["expert_load_max_over_mean"] <= 8 for m in rows)
