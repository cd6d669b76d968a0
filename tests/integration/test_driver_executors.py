"""Both executors run the same step DAG on real role groups and agree exactly; calls on
disjoint meshes overlap in time."""

from __future__ import annotations

import pytest
import torch

from rayhf.data.datasets import to_packed
from rayhf.runtime.assets import prepare_run
from rayhf.runtime.driver import DagExecutor
from rayhf.runtime.probe import probe_batch, probe_executor
from rayhf.runtime.session import Session

pytestmark = pytest.mark.ray

DISJOINT = {  # the actor on device 0, ref and reward on 1; the critic infers on 0 and trains on 1
    "actor_gen": {"mesh": [0]}, "actor_train": {"mesh": [0]}, "ref_inf": {"mesh": [1]},
    "rew_inf": {"mesh": [1]}, "critic_inf": {"mesh": [0]}, "critic_train": {"mesh": [1]},
}  # fmt: skip


def _same_batches(a, b) -> bool:
    return a.sample_ids == b.sample_ids and a.keys() == b.keys() and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors
    )  # fmt: skip


def test_plain_and_compiled_executors_agree_and_train(ray_cluster, tiny_config):
    import ray

    cfg = tiny_config(steps=1, plan=DISJOINT, **{"cluster.n_devices": 2})
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        placement = session.placement()
        batch = to_packed(assets.dataset.next_batch(cfg.batch_size, cfg.seed))
        plain = DagExecutor(assets.graph, placement, compiled=False)
        compiled = DagExecutor(assets.graph, placement, compiled=True, timeout_s=300)
        try:
            a = plain.run_step(1, batch, evaluate=True)
            b = compiled.run_step(1, batch, evaluate=True)
            assert _same_batches(a.batch, b.batch), "same DAG, same seeds: same outputs"
            assert a.stats == b.stats and "scores" in a.batch.tensors
            before = ray.get(session.groups["actor"].actors[0].weights_summary.remote()).digest
            trained = compiled.run_step(1, batch)  # switches to the train DAG
            assert {"policy_loss", "value_loss"} <= set(trained.stats)
        finally:
            compiled.close()
        after = ray.get(session.groups["actor"].actors[0].weights_summary.remote()).digest
        assert after != before, "the compiled train step updated the actor"
        out = plain.run_step(2, batch)  # the actors take plain calls again after the teardown
        assert {"policy_loss", "value_loss"} <= set(out.stats)


@pytest.mark.alone  # two 0.3 s calls that overlap: not beside another test's load
@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled"])
def test_calls_on_disjoint_meshes_run_at_the_same_time_and_shared_ones_in_turn(
    ray_cluster, compiled
):
    for meshes, together in (([(0,), (1,)], True), ([(0,), (0,)], False)):
        executor, groups = probe_executor(meshes, chain=False, seconds=0.3, compiled=compiled)
        try:
            executor.run_step(0, probe_batch())  # the actors have started
            spans = executor.run_step(1, probe_batch()).spans
        finally:
            executor.close()
            for g in groups:
                g.kill()
        a, b = sorted(spans, key=lambda s: s.start)
        overlap = b.start < a.end
        assert overlap == together, f"{meshes}: {a} / {b}"


def test_a_run_on_the_compiled_executor_checkpoints_and_continues(ray_cluster, tiny_config):
    from rayhf.runtime.trainer import run

    # 2 steps, a checkpoint after each; a compiled graph runs one step at a time
    cfg = tiny_config(**{"driver.executor": "compiled", "driver.overlap_steps": False})
    result = run(cfg)  # each checkpoint tears the compiled graph down; the next step recompiles
    assert [m["step"] for m in result.metrics] == [1, 2]
    assert len(result.checkpoints) == 2 and result.policy_checkpoint is not None
