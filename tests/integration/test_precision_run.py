"""PPO with every role at bf16 on Ray role groups: the actor trains fp32 master weights under
autocast and generates from a bf16 copy on other devices, which each step's reallocation fills
with bf16 slices; the reference is a bf16 copy of the actor."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rayhf.runtime.assets import prepare_run
from rayhf.runtime.session import Session
from rayhf.runtime.trainer import RunLoop

pytestmark = pytest.mark.ray

PLAN = {
    "actor_gen": {"mesh": [1]},
    "actor_train": {"mesh": [0]},
    "critic_inf": {"mesh": [0]},
    "critic_train": {"mesh": [0]},
    "ref_inf": {"mesh": [1]},
    "rew_inf": {"mesh": [1]},
}


def test_bf16_roles_train_fp32_masters_and_move_bf16_copies(ray_cluster, tiny_config):
    import ray

    bf16 = {f"models.{r}.precision": "bf16" for r in ("actor", "ref", "critic")}
    cfg = tiny_config(steps=2, plan=PLAN, **{"cluster.n_devices": 2}, **bf16)
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        actor, ref = session.groups["actor"], session.groups["ref"]
        (copy,) = [g for g in session.copies.values() if g.role == "actor"]
        assert (actor.dtype, copy.dtype, ref.dtype) == ("fp32", "bf16", "bf16")
        n_params = ray.get(actor.actors[0].weights_summary.remote()).bytes // 4
        assert ray.get(ref.actors[0].weights_summary.remote()).bytes == 2 * n_params
        master = ray.get(actor.actors[0].get_weights.remote())
        ref_weights = ray.get(ref.actors[0].get_weights.remote())
        assert {t.dtype for t in ref_weights.values()} == {torch.bfloat16}
        assert all(torch.equal(ref_weights[k], v.to(torch.bfloat16)) for k, v in master.items())
        trainer = RunLoop(cfg, assets, session)
        trainer.loop(0)
        generated = ray.get(copy.actors[0].get_weights.remote())
        trained = ray.get(actor.actors[0].get_weights.remote())
    assert not all(torch.equal(master[k], trained[k]) for k in master), "the actor did not train"
    assert {t.dtype for t in generated.values()} == {torch.bfloat16}
    assert {t.dtype for t in trained.values()} == {torch.float32}
    lines = (assets.run_dir / "metrics.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines]
    assert [h["step"] for h in history] == [1, 2]
    for stats in history:
        numbers = [v for v in stats.values() if isinstance(v, float)]
        assert numbers and all(math.isfinite(v) for v in numbers), stats
