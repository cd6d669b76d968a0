"""Asynchronous RL (``algorithm.max_staleness``): at k=0 the numbers stay those recorded (until
the sampler changed, those rayhf gave before max_staleness existed); with k=1 the generation of
step i+1 runs while step i trains, every batch's policy version is within the bound and the
trace shows it, and a recovery from a checkpoint ends with the weights an uninterrupted run ends
with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import PPO_CALLS, REPO, needs_vllm, tiny_overrides
from safetensors.torch import load_file
from trace_support import assert_trace_is_priced, spans_by_step

import rayhf
from rayhf.runtime.assets import prepare_run

pytestmark = pytest.mark.ray

CALLS = {"ppo": PPO_CALLS, "grpo": ("actor_gen", "rew_inf", "ref_inf", "actor_train")}
# tiny PPO and GRPO runs at k=0, recorded when sampling became counter-based (the static decode
# step); the file held the same runs at commit 4392fee, before max_staleness existed, until then.
# Re-recorded with the sliced scoring head and fused AdamW: every figure the same to 6
# significant digits but value_clip_frac, which counts ties (values equal to the old ones up to
# rounding) that rounding breaks
BEFORE = Path(__file__).with_name("on_policy_numbers.json")
TIMING = ("seconds", "per_s", "peak_memory")  # what the machine measures, not the step
# the actor generates on device 0 beside the frozen models (reference, reward), which then run
# a step ahead with it; the actor and the critic train on device 1
BESIDE = {c: {"mesh": [0] if c in ("actor_gen", "ref_inf", "rew_inf") else [1]} for c in PPO_CALLS}


def _config(tmp: Path, **extra: object) -> rayhf.ExperimentConfig:
    ov = tiny_overrides(
        tmp / "run", steps=4, save_every=2, plan=BESIDE,
        **{"cluster.n_devices": 2, "algorithm.max_staleness": 1},
    )  # fmt: skip
    ov.update(extra)
    return rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(ov)


def _final_weights(result: rayhf.RunResult) -> dict[str, torch.Tensor]:
    ckpt = result.final_checkpoint
    assert ckpt is not None and json.loads((ckpt / "state.json").read_text())["step"] == 4
    return {
        f"{role}/{k}": v
        for role in ("actor", "critic")
        for k, v in load_file(ckpt / role / "model.safetensors").items()
    }


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_at_staleness_0_the_numbers_stay_those_recorded(ray_cluster, tmp_path, algo):
    plan = {c: {"mesh": [0] if c == "actor_gen" else [1]} for c in CALLS[algo]}
    cfg = rayhf.load_config(REPO / "examples" / f"{algo}_tiny.yaml").with_overrides(
        {
            "run_dir": str(tmp_path / algo), "dataset.path": str(tmp_path / "echo.parquet"),
            "steps": 3, "batch_size": 8, "save_every": 0, "plan": plan,
            "generation.max_new_tokens": 6, "metrics.console": False, "metrics.plot": False,
            "metrics.ray_metrics": False, "cluster.n_devices": 2,
        }
    )  # fmt: skip
    before = json.loads(BEFORE.read_text())[algo]
    rows = rayhf.run(cfg).metrics
    # Bit for bit on one machine; another CPU's kernels (AVX2 against AVX-512) round float32's
    # last bits differently, so the recorded numbers are compared to a relative 1e-5 (1e-6 near
    # 0). Clip fractions are left out: they count the few tokens near a bound, which that
    # rounding moves across it (0.0625 against 0 on a step of this tiny batch).
    for r, b in zip(rows, before, strict=True):
        for key, value in b.items():
            if not key.endswith("clip_frac"):
                assert r[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (r["step"], key)
    assert all(r["async/staleness"] == 0 and 0 <= r["logprob_mismatch"] < 1e-5 for r in rows)


# the module's run places its proximal log-probs by each sample's version (the default proximal
# at k=1 is the frozen-models, the vLLM and the CLI's SIGTERM runs')
INTERPOLATE = {"algorithm.proximal": "interpolate"}


@pytest.fixture(scope="module")
def uninterrupted(ray_cluster, tmp_path_factory) -> tuple[rayhf.ExperimentConfig, rayhf.RunResult]:
    cfg = _config(tmp_path_factory.mktemp("async"), **INTERPOLATE)
    return cfg, rayhf.run(cfg)


def test_generation_of_the_next_step_runs_while_this_one_trains_within_the_bound(uninterrupted):
    cfg, result = uninterrupted
    rows = result.metrics
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # step 1 samples with the initial weights; steps 3 and 4 follow a checkpoint at step 2,
    # which drains the pipeline, so step 3 samples on-policy again
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert all(r["is_weight_mean"] > 0 and r["logprob_mismatch"] >= 0 for r in rows)
    steps = spans_by_step(result.run_dir)
    for i in (1, 3):
        gen = next(e for e in steps[i + 1] if e["name"] == "actor_gen")
        train = next(e for e in steps[i] if e["name"] == "actor_train")
        assert gen["ts"] < train["ts"] + train["dur"], f"step {i + 1} generates as {i} trains"
    for step, spans in steps.items():
        gen = next(e for e in spans if e["name"] == "actor_gen")
        assert 0 <= step - 1 - gen["args"]["version"] <= 1 and gen["args"]["staleness"] <= 1
    assert_trace_is_priced(cfg, prepare_run(cfg, result.run_dir))


def test_the_frozen_models_beside_the_generation_run_ahead_with_it(ray_cluster, tmp_path):
    """Step 2's generation and reference run while step 1 trains. Without the reference in the
    leading part it would wait behind step 3's generation, which waits for step 1's update."""
    cfg = _config(tmp_path, steps=3, save_every=0)
    result = rayhf.run(cfg)
    assert [r["async/staleness"] for r in result.metrics] == [0.0, 1.0, 1.0]
    steps = spans_by_step(result.run_dir)
    train = next(e for e in steps[1] if e["name"] == "actor_train")
    gen = next(e for e in steps[2] if e["name"] == "actor_gen")
    assert gen["ts"] < train["ts"] + train["dur"], "step 2 generates as step 1 trains"
    # step 3's generation starts only after step 1's update: the frozen models of step 2 start
    # before it (how long the train call takes does not decide this, as it would a time overlap)
    after = next(e for e in steps[3] if e["name"] == "actor_gen")
    for call in ("ref_inf", "rew_inf"):
        ahead = next(e for e in steps[2] if e["name"] == call)
        assert ahead["ts"] < after["ts"], f"step 2's {call} waited behind step 3's generation"
    assert_trace_is_priced(cfg, prepare_run(cfg, result.run_dir))


def test_interpolated_proximal_log_probs_read_each_sample_s_version(uninterrupted):
    """With ``proximal: interpolate`` the train call places the proximal log-probs by each
    sample's version tag: where the samples are on-policy (steps 1 and 3, after the checkpoint's
    drain) they are the behaviour ones, so every weight is 1 (a wrong tag would move them)."""
    _, result = uninterrupted
    rows = result.metrics
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 0.0, 1.0]
    assert [r["async/policy_version"] for r in rows] == [0.0, 0.0, 2.0, 2.0]
    for r in rows[0::2]:
        assert abs(r["is_weight_mean"] - 1) < 1e-5 and r["is_weight_max"] < 1 + 1e-5, r
        assert r["logprob_mismatch"] < 1e-5
    assert all(r["is_weight_max"] > 1.01 and r["logprob_mismatch"] > 1e-3 for r in rows[1::2])


def test_a_recovery_of_an_asynchronous_run_ends_as_the_uninterrupted_one(uninterrupted, tmp_path):
    _, result = uninterrupted
    fault = {"site": "call", "step": 4, "role": "critic"}
    recovered = rayhf.run(_config(tmp_path, **INTERPOLATE, **{"fault_tolerance.inject": fault}))
    assert recovered.info["recoveries"] == 1
    assert [r["step"] for r in recovered.metrics] == [1, 2, 3, 4]
    want, got = _final_weights(result), _final_weights(recovered)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"{len(differ)} of {len(want)} tensors differ after the recovery"


@needs_vllm
def test_vllm_generates_a_step_ahead_on_the_previous_policy(ray_cluster, tmp_path):
    """With vLLM as the generator at k=1: it reloads (and checks) the weights of each newer
    version before it samples, one version behind the trainer, while the trainer trains."""
    vllm = {
        "engines": {"actor_gen": {"engine": "vllm"}}, "save_every": 0,
        "models.actor.init.n_heads": 2, "models.actor.init.n_kv_heads": 1,  # vLLM: head_dim 32
    }  # fmt: skip
    result = rayhf.run(_config(tmp_path, **vllm))
    rows = result.metrics
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["async/policy_version"] for r in rows] == [0.0, 0.0, 1.0, 2.0]
    assert rows[0]["logprob_mismatch"] < 1e-5 < min(r["logprob_mismatch"] for r in rows[1:])
    steps = spans_by_step(result.run_dir)
    for i in (1, 2, 3):
        gen = next(e for e in steps[i + 1] if e["name"] == "actor_gen")
        train = next(e for e in steps[i] if e["name"] == "actor_train")
        assert gen["ts"] < train["ts"] + train["dur"], f"step {i + 1} generates as {i} trains"
