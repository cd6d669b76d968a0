"""LoRA roles in a real PPO run: the actor's and the critic's weights frozen, their adapters (and
the critic's value head) trained, optimizer state for those alone, checkpoints PEFT loads; and a
PEFT-saved adapter starts a run."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, tiny_overrides
from safetensors.torch import load_file

import rayhf
from rayhf.metrics.trace import read_trace
from rayhf.models.files import ADAPTER_DIR
from rayhf.models.lora import ADAPTER_CONFIG, ADAPTER_FILE
from rayhf.runtime.trainer import run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LORA = {"models.actor.lora.rank": 4, "models.critic.lora.rank": 2, "cluster.n_devices": 2}
LORA["models.critic.lora.dropout"] = 0.1  # in its train calls, recorded in its PEFT config
# the actor generates on a tp = 2 copy: its adapters move there after every train step
PLAN = {c: {"dp": 2} for c in ("actor_train", "critic_inf", "critic_train", "ref_inf", "rew_inf")}
PLAN["actor_gen"] = {"tp": 2}


def _tensors(model_dir):
    return load_file(str(model_dir / "model.safetensors"))


def test_lora_roles_train_their_adapters_alone_and_a_peft_adapter_starts_a_run(
    ray_cluster, tiny_config, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result = run(tiny_config(**LORA, plan=PLAN, **{"algorithm.old_logprobs": "generator"}))
    # the generator's log-probs are the trainer's before its first update: the same adapters
    assert max(m["logprob_mismatch"] for m in result.metrics) < 1e-4
    # the reference for free: the actor computes it on its base weights, no group of its own
    trace = read_trace(result.run_dir / "trace.json")
    spans = [e for e in trace if e.get("name") == "ref_inf"]
    assert spans and {e["args"]["role"] for e in spans} == {"actor"}
    step = result.run_dir / "checkpoints" / "step_000002"
    # the adapters move alone: the copy keeps its frozen weights, so each move to it carries
    # each tp rank's share of the adapters (an A or a B whole on both ranks, the other split)
    n = 4 * sum(
        t.numel() for t in load_file(str(step / "actor" / ADAPTER_DIR / ADAPTER_FILE)).values()
    )
    moves = [e["args"]["bytes"] for e in trace if e.get("name") == "realloc:actor_gen"]
    assert len(moves) == 2 and all(n < b < 2 * n for b in moves), (moves, n)
    for role, n_adapted in (("actor", 2 * 7), ("critic", 2 * 7)):
        base, saved = _tensors(result.run_dir / "init" / role), _tensors(step / role)
        moved = {k for k in base if not torch.equal(base[k], saved[k])}
        assert moved == ({"score.weight"} if role == "critic" else set()), role
        adapter = load_file(str(step / role / ADAPTER_DIR / ADAPTER_FILE))
        b = [t for k, t in adapter.items() if ".lora_B." in k]
        assert len(b) == n_adapted and all(t.abs().sum() > 0 for t in b), role  # trained
        state = torch.load(step / "optim" / f"{role}.rank0.pt", weights_only=False)
        held = len(state["optimizer"]["state"])  # AdamW's moments: adapters (and head) only
        assert held == 2 * n_adapted + (role == "critic"), role
    critic = json.loads((step / "critic" / ADAPTER_DIR / ADAPTER_CONFIG).read_text())
    assert critic["lora_dropout"] == 0.1
    config = json.loads((step / "actor" / ADAPTER_DIR / ADAPTER_CONFIG).read_text())
    assert config["lora_dropout"] == 0.0
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # PEFT loads the actor's adapter onto its base and saves it again: that starts a run
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(step / "actor"), step / "actor" / ADAPTER_DIR
    )
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        adapted = peft(ids).logits
        with peft.disable_adapter():
            assert not torch.allclose(adapted, peft(ids).logits)
    peft.save_pretrained(tmp_path / "peft")
    again = {
        "models.actor.init": None,
        "models.actor.path": str(step / "actor"),
        "models.actor.lora.adapter": str(tmp_path / "peft"),
        "models.actor.optimizer.lr": 1e-12,  # the adapter it starts from, all but kept
    }
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml")
    again = run(cfg.with_overrides(tiny_overrides(tmp_path / "again", **LORA, **again, steps=1)))
    # the adapter it starts from moves the actor off its base, the reference's weights: KL > 0
    # from the first step (a reference computed with the adapters on would give 0)
    assert abs(again.metrics[0]["kl"]) > 1e-4  # (a sampled estimate: either sign)
    first = again.run_dir / "checkpoints" / "step_000001" / "actor" / ADAPTER_DIR / ADAPTER_FILE
    want = load_file(str(step / "actor" / ADAPTER_DIR / ADAPTER_FILE))
    assert load_file(str(first)).keys() == want.keys()
    got = load_file(str(first))
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-9) for k in want)
