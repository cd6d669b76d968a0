"""A run recovers by itself from a dead actor at every site a step waits on (a call, a weight
move, a checkpoint write, start-up, an evaluation, a vLLM weight sync), and ends with the weights
an uninterrupted run ends with; with ``fault_tolerance.max_restarts: 0`` the same fault stops the
run in one line naming the role, the actor and what it was doing, with no actor left behind.

The faults are injected (``fault_tolerance.inject``): the named actor SIGKILLs itself where it
reaches the site. One run meets a fault at each site in turn, one per attempt, so each recovery
restores the checkpoint of the step before the fault and the next fault comes one step later.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, alive_actors, needs_vllm, tiny_overrides
from safetensors.torch import load_file

import rayhf
from rayhf.errors import RunFailed
from rayhf.metrics.trace import TRACE_FILE, read_trace

pytestmark = pytest.mark.ray

# The actor trains on device 0 and generates on device 1: every step moves its weights.
PLAN = {
    "actor_train": {"mesh": [0]}, "critic_inf": {"mesh": [0]}, "critic_train": {"mesh": [0]},
    "actor_gen": {"mesh": [1]}, "ref_inf": {"mesh": [1]}, "rew_inf": {"mesh": [1]},
}  # fmt: skip
# site -> what the failure says the actor was doing, in the order one run meets them: the first
# attempt's actor dies starting up, then each attempt dies one step later than the one before
SITES = {
    "startup": "during start-up",
    "call": "during call 'actor_gen'",
    "move": "during weight move 'realloc:actor_gen'",
    "eval": "during eval call 'actor_gen'",  # the evaluation after the step, before its checkpoint
    "checkpoint": "during checkpoint write",
}
STEPS = len(SITES)


def _config(tmp: Path, **extra: object) -> rayhf.ExperimentConfig:
    (tmp / "data").mkdir(parents=True, exist_ok=True)
    ov = tiny_overrides(
        tmp / "run", steps=STEPS, eval_every=1, plan=PLAN,
        **{"cluster.n_devices": 2, "dataset.eval_path": str(tmp / "data" / "eval.parquet")},
    )  # fmt: skip
    ov.update(extra)
    return rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(ov)


def _fault(site: str) -> dict[str, object]:
    return {"fault_tolerance.inject": {"site": site, "step": 2, "role": "actor"}}


def _recovery_spans(result: rayhf.RunResult) -> list[dict]:
    return [e for e in read_trace(result.run_dir / TRACE_FILE) if e.get("cat") == "recovery"]


def _weights(result: rayhf.RunResult) -> dict[str, torch.Tensor]:
    ckpt = result.final_checkpoint
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] == STEPS
    return {
        f"{role}/{k}": v
        for role in ("actor", "critic")
        for k, v in load_file(ckpt / role / "model.safetensors").items()
    }


def test_a_dead_actor_at_each_site_is_recovered_and_the_run_ends_as_an_uninterrupted_one(
    ray_cluster, tmp_path
):
    faults = [{"site": site, "step": n, "role": "actor"} for n, site in enumerate(SITES, 1)]
    drill = {"fault_tolerance.inject": faults, "fault_tolerance.max_restarts": len(faults)}
    result = rayhf.run(_config(tmp_path / "drill", **drill))
    assert result.info["recoveries"] == len(SITES)
    assert [m["step"] for m in result.metrics] == [0, *range(1, STEPS + 1)], "each logged once"
    recovered = [m for m in result.metrics if "recovery/seconds" in m]
    # a recovery's metrics go in the first step after it: the one its fault stopped
    assert [m["step"] for m in recovered] == list(range(1, STEPS + 1))
    assert [m["recovery/count"] for m in recovered] == list(range(1, STEPS + 1))
    assert all(m["recovery/seconds"] > 0 for m in recovered)
    spans = _recovery_spans(result)
    assert len(spans) == len(SITES)
    for span, (site, doing) in zip(spans, SITES.items(), strict=True):
        assert doing in span["args"]["reason"], f"{site}: {span['args']['reason']}"
    weights = _weights(result)
    uninterrupted = _weights(rayhf.run(_config(tmp_path / "uninterrupted")))
    assert weights.keys() == uninterrupted.keys()
    differ = [k for k in weights if not torch.equal(weights[k], uninterrupted[k])]
    assert not differ, f"after the recoveries {len(differ)} tensors differ, e.g. {differ[:3]}"


# the message and the teardown are the same code at every site: one site inside a step and
# start-up, where the groups are not yet formed
@pytest.mark.parametrize("site", ["move", "startup"])
def test_with_no_restarts_a_dead_actor_at_each_site_stops_the_run_in_one_line(
    ray_cluster, tmp_path, site
):
    cfg = _config(tmp_path, **_fault(site), **{"fault_tolerance.max_restarts": 0})
    with pytest.raises(RunFailed) as failed:
        rayhf.run(cfg)
    message = str(failed.value)
    assert "\n" not in message and message.startswith("role 'actor': actor actor.d")
    assert SITES[site] in message and f"rayhf run --resume {cfg.run_dir}" in message
    assert not [a for a in alive_actors() if a.split(".")[0] in cfg.models]


@needs_vllm
def test_a_dead_actor_in_a_vllm_weight_sync_is_recovered(ray_cluster, tmp_path):
    vllm = {
        "engines": {"actor_gen": {"engine": "vllm"}}, "steps": 2, "eval_every": 0,
        "models.actor.init.n_heads": 2, "models.actor.init.n_kv_heads": 1,  # vLLM: head_dim 32
    }  # fmt: skip
    result = rayhf.run(_config(tmp_path, **vllm, **_fault("sync")))
    assert result.info["recoveries"] == 1
    assert [m["step"] for m in result.metrics] == [1, 2]
    spans = _recovery_spans(result)
    died = "actor actor.d1.dp1tp1pp1[0] died during call 'actor_gen'"  # the sync's call
    assert len(spans) == 1 and died in spans[0]["args"]["reason"], spans
    plain = rayhf.run(_config(tmp_path / "plain", **vllm))
    final = "actor/model.safetensors"
    assert result.final_checkpoint is not None and plain.final_checkpoint is not None
    a = load_file(result.final_checkpoint / final)
    b = load_file(plain.final_checkpoint / final)
    assert all(torch.equal(a[k], b[k]) for k in a), "vLLM samples the same after a recovery"
