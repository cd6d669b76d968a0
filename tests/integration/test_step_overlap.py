"""Steps overlap where the dataflow allows (``driver.overlap_steps``): the same numbers as one
step at a time, step i+1's first calls running while step i's last ones do, and every step
running exactly the units the planner prices."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PPO_CALLS
from trace_support import assert_trace_is_priced, spans_by_step

from rayhf.runtime.assets import prepare_run
from rayhf.runtime.trainer import run

pytestmark = [pytest.mark.ray, pytest.mark.alone]  # step 2 starts within a critic's train call

ACTOR_SIDE = ("actor_gen", "actor_train", "ref_inf")
# the actor's calls on device 0, the critic's and the reward's on device 1
SPLIT = {c: {"mesh": [0] if c in ACTOR_SIDE else [1]} for c in PPO_CALLS}
TIMING = ("seconds", "per_s", "peak_memory")  # what the machine measures, not the step


def _numbers(rows: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]


def _config(tiny_config, run_dir: Path, overlap: bool):
    return tiny_config(
        steps=3, save_every=0, plan=SPLIT,
        **{
            "cluster.n_devices": 2,
            "driver.overlap_steps": overlap,
            "models.ref.ema": 0.5,  # a blend between steps too
            # a critic that trains well past the actor's update, so the next step's generation
            # has something to run beside even on a loaded machine (128 wide x 6 layers once
            # ended 4.5 ms before it, in a full suite)
            "models.critic.init.hidden_size": 192,
            "models.critic.init.n_layers": 8,
        },
    ).with_overrides({"run_dir": str(run_dir)})  # fmt: skip


def test_overlapped_steps_give_the_same_numbers_and_run_beside_each_other(
    ray_cluster, tiny_config, tmp_path
):
    overlapped_cfg = _config(tiny_config, tmp_path / "overlap", True)
    overlapped = run(overlapped_cfg)
    barrier = run(_config(tiny_config, tmp_path / "barrier", False))
    assert _numbers(overlapped.metrics) == _numbers(barrier.metrics)
    assert len(overlapped.metrics) == 3
    steps = spans_by_step(overlapped.run_dir)
    # step 2 generates while step 1's critic still trains (the critic is no barrier for it)
    critic_end = next(e["ts"] + e["dur"] for e in steps[1] if e["name"] == "critic_train")
    gen_start = next(e["ts"] for e in steps[2] if e["name"] == "actor_gen")
    assert gen_start < critic_end
    # on-policy: it generates only after the actor trained and the ref blended in step 1
    updates = ("actor_train", "ema:ref")
    updates_end = max(e["ts"] + e["dur"] for e in steps[1] if e["name"] in updates)
    assert gen_start >= updates_end
    # one step at a time: nothing of step i+1 starts before all of step i ended
    by_step = spans_by_step(barrier.run_dir)
    for i in (1, 2):
        assert min(e["ts"] for e in by_step[i + 1]) >= max(e["ts"] + e["dur"] for e in by_step[i])
    assert_trace_is_priced(overlapped_cfg, prepare_run(overlapped_cfg, overlapped.run_dir))
