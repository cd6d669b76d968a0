"""The real runtime: Ray actors on emulated devices, gloo data parallelism, PPO steps."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import alive_actors
from transformers import AutoModelForCausalLM

import rayhf
from rayhf.runtime.assets import prepare_run
from rayhf.runtime.session import Session
from rayhf.runtime.trainer import RunLoop, run

pytestmark = pytest.mark.ray


def _weights(path):
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_two_ppo_steps_on_two_devices(ray_cluster, tiny_config):
    cfg = tiny_config(**{"metrics.ray_metrics": True, "metrics.plot": True, "cluster.n_devices": 2})
    result = run(cfg)
    assert [m["step"] for m in result.metrics] == [1, 2]
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and "task_reward" in json.loads(lines[0])
    for key in ("policy_loss", "value_loss", "kl", "seconds/actor_gen", "tokens_per_s"):
        assert key in result.metrics[-1], key
    before = _weights(result.run_dir / "init" / "actor")
    after = _weights(result.policy_checkpoint)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before), "every actor tensor should move after 2 PPO steps"
    assert result.plot is not None and result.plot.stat().st_size > 1000
    assert result.info["init_realloc_bytes"] > 0  # ref weights came from the actor
    chosen = json.loads((result.run_dir / "plan.json").read_text())  # plan: auto searched it
    assert set(chosen) == {"actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train",
                           "critic_train"}  # fmt: skip
    assert all(set(lay["mesh"]) <= {0, 1} for lay in chosen.values())
    shown = rayhf.make_plan(cfg)  # what `rayhf plan` shows: the same search, no Ray
    assert json.loads(shown.to_json()) == chosen


def test_role_groups_are_named_actors_and_dp_replicas_agree(ray_cluster, tiny_config):
    import ray

    cfg = tiny_config(steps=1, plan="colocated", **{"cluster.n_devices": 2})
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        alive = alive_actors()
        for role in ("actor", "critic", "ref", "reward"):
            for rank in (0, 1):
                assert f"{role}.d0-1.dp2tp1pp1[{rank}]" in alive
        actor, ref = session.groups["actor"], session.groups["ref"]
        digests = [
            w.digest
            for w in ray.get([a.weights_summary.remote() for a in actor.actors + ref.actors])
        ]
        assert len(set(digests)) == 1, "ref must start as an exact copy of the actor"
        RunLoop(cfg, assets, session).loop(0)
        after = [w.digest for w in ray.get([a.weights_summary.remote() for a in actor.actors])]
        assert after[0] == after[1], "dp replicas must stay identical (gradients all-reduced)"
        assert after[0] != digests[0]
    assert not [a for a in alive_actors() if a.startswith(("actor.", "critic.", "ref."))]


def test_token_budgets_checkpointing_and_offload_change_memory_not_results(
    ray_cluster, tiny_config, tmp_path
):
    """A budget a few samples wide on the actor's train and the reference's inference, and the
    train calls' optimizers in host memory (``offload``): the same step as without them
    (gradients accumulate; log-probs are per sample; AdamW steps a host copy)."""
    budget = {"engine": "torch", "max_tokens_per_microbatch": 24}  # prompts <= 18 + 4 new
    trained = {**budget, "offload": True}
    # one minibatch of all 4 samples, so the budget has something to cut
    runs = {}
    cut = {"actor_train": trained, "critic_train": trained, "ref_inf": budget}
    for name, engines in (("whole", {}), ("cut", cut)):
        cfg = tiny_config(engines=engines, plan="colocated", **{"algorithm.n_minibatches": 1})
        if name == "cut":  # and the actor recomputes its activations: still the same step
            cfg = cfg.with_overrides({"models.actor.activation_checkpointing": True})
        cfg = cfg.with_overrides({"run_dir": str(tmp_path / name)})
        runs[name] = run(cfg).metrics
    assert not any("micro_batches" in m for m in runs["whole"])
    cut_rows = [(m.get("micro_batches"), m["step"]) for m in runs["cut"]]
    assert cut_rows and all(n is not None and n > 1.0 for n, _ in cut_rows), cut_rows
    for key in ("kl", "policy_loss", "value_loss", "task_reward", "grad_norm"):
        whole = [m[key] for m in runs["whole"]]
        assert [m[key] for m in runs["cut"]] == pytest.approx(whole, rel=1e-3, abs=1e-6), key
