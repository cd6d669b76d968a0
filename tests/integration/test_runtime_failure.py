"""An actor that dies mid-run stops the run at once, naming its role, and leaves nothing behind."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import alive_actors

from rayhf.errors import RunFailed
from rayhf.runtime.assets import prepare_run
from rayhf.runtime.session import Session
from rayhf.runtime.trainer import RunLoop
from rayhf.runtime.waits import gather, pending

pytestmark = pytest.mark.ray

PLAN = {  # the critic is pipelined: its surviving stage blocks on the dead one's activations
    "actor_gen": {"dp": 2}, "actor_train": {"dp": 2}, "ref_inf": {"dp": 2}, "rew_inf": {"dp": 2},
    "critic_inf": {"pp": 2, "n_microbatches": 2}, "critic_train": {"pp": 2, "n_microbatches": 2},
}  # fmt: skip


def test_a_dead_actor_stops_the_run_naming_its_role(ray_cluster, tiny_config):
    import ray

    cfg = tiny_config(steps=2, plan=PLAN, **{"cluster.n_devices": 2})
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        ray.kill(session.groups["critic"].actors[1], no_restart=True)
        began = time.monotonic()
        with pytest.raises(RunFailed) as failed:
            RunLoop(cfg, assets, session).loop(0)
        waited = time.monotonic() - began
    message = str(failed.value)
    print(f"stopped {waited:.1f} s after the kill: {message}")
    assert "role 'critic'" in message and "critic.d0-1.dp1tp1pp2[1]" in message
    assert "during call 'critic_inf'" in message
    assert waited < 60, f"the run took {waited:.0f} s to notice"
    assert not [a for a in alive_actors() if a.split(".")[0] in cfg.models]


def test_a_wait_past_its_timeout_fails_naming_the_actor_that_has_not_answered(ray_cluster):
    import ray

    class _Sleeper:  # defined here: pickled by value (workers cannot import the test module)
        def nap(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    actors = [ray.remote(_Sleeper).options(num_cpus=0).remote() for _ in range(2)]
    try:
        # both up first: on a loaded machine an actor's start alone can take past the 2 s timeout
        ray.get([a.nap.remote(0.0) for a in actors], timeout=120)
        calls = [
            pending(a.nap.remote(s), a, "critic", f"critic.d0.dp1tp1pp1[{r}]", "checkpoint write")
            for r, (a, s) in enumerate(zip(actors, (0.0, 60.0), strict=True))
        ]
        began = time.monotonic()
        with pytest.raises(RunFailed) as failed:
            gather(calls, timeout_s=2)
        assert time.monotonic() - began < 10
        assert str(failed.value) == (
            "role 'critic': actor critic.d0.dp1tp1pp1[1] did not finish checkpoint write "
            "within 2 s (driver.call_timeout_s)"
        )
        assert gather(calls[:1], timeout_s=2) == [0.0]
    finally:
        for a in actors:
            ray.kill(a)


def test_a_non_finite_gradient_is_skipped_counted_and_in_a_row_stops_the_run(
    ray_cluster, tiny_config
):
    """From step 2 the actor's gradients are NaN (an injected drill): its 4 optimizer steps of
    step 2 are skipped and counted, the step-2 checkpoint holds the step-1 weights, finite; the
    6th skip in a row (in step 3) stops the run with the error naming the setting, one line."""
    import json

    from safetensors.torch import load_file

    import rayhf
    from rayhf.engines.torch_trainer import NonFiniteGradients

    cfg = tiny_config(
        steps=3,
        **{
            "fault_tolerance.inject": {"site": "nonfinite", "step": 2, "role": "actor"},
            "models.actor.optimizer.max_skipped_steps": 6,
        },
    )
    with pytest.raises(NonFiniteGradients, match="6 optimizer steps in a row") as stopped:
        rayhf.run(cfg)
    assert "\n" not in str(stopped.value)
    run = cfg.resolved_run_dir()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r.get("skipped_steps", 0.0) for r in rows if "step" in r}
    assert skipped == {1: 0.0, 2: 4.0}
    weights = [
        load_file(run / "checkpoints" / f"step_{s:06d}" / "actor" / "model.safetensors")
        for s in (1, 2)
    ]
    assert all(torch.isfinite(v).all() for v in weights[1].values())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
