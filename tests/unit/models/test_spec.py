"""A model's shape read from its Hugging Face config, family by family, and the families and
features refused with a message that says what to use."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from rayhf.errors import RayhfError
from rayhf.models.families import FAMILIES
from rayhf.models.hf import ModelInit, build_model, hf_config
from rayhf.models.sharding import param_shards
from rayhf.models.spec import MoESpec, model_spec

IDS = {"pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 1}
SIZES = {
    "vocab_size": 40,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 72,
    "max_position_embeddings": 64,
}


def test_llama_spec():
    cfg = LlamaConfig(**SIZES, **IDS, rms_norm_eps=1e-5, rope_theta=500.0)
    spec = model_spec(cfg, value_head=False)
    freqs = tuple(float(torch.tensor(500.0 ** (-i / 8), dtype=torch.float32)) for i in (0, 2, 4, 6))
    assert dataclasses.asdict(spec) == {
        "family": "llama", "traits": dataclasses.asdict(FAMILIES["llama"]), "vocab_size": 40,
        "hidden_size": 32, "n_layers": 3, "n_heads": 4,
        "n_kv_heads": 2, "head_dim": 8, "intermediate_size": 72, "max_positions": 64,
        "norm_eps": 1e-5, "act": "silu", "rope_theta": 500.0, "qkv_bias": False, "o_bias": False,
        "mlp_bias": False, "sliding_window": None, "tied": False, "value_head": False,
        "padding_idx": 0, "rope_inv_freq": pytest.approx(freqs, rel=1e-6), "rope_scale": 1.0,
        "window_layers": None, "rope_inv_freq_local": None,
        "rope_scale_local": 1.0, "embed_scale": 1.0, "attn_scale": None,
        "attn_softcap": None, "final_softcap": None, "dtype_bytes": 0, "master": False,
        "moe": None, "moe_layers": (), "qk_norm": False, "delta_net": None, "delta_layers": (),
        "lora": None,
    }  # fmt: skip
    assert (spec.prefix, spec.head_name) == ("model", "lm_head.weight")


def test_llama_biases_and_an_explicit_head_dim():
    cfg = LlamaConfig(**SIZES, attention_bias=True, mlp_bias=True, head_dim=16)
    spec = model_spec(cfg, value_head=True)
    assert (spec.qkv_bias, spec.o_bias, spec.mlp_bias) == (True, True, True)
    assert spec.head_dim == 16  # not hidden_size / heads
    assert spec.head_name == "score.weight" and spec.value_head


def test_qwen2_has_qkv_biases_and_an_optional_window():
    spec = model_spec(Qwen2Config(**SIZES), value_head=False)
    assert (spec.family, spec.qkv_bias, spec.o_bias, spec.sliding_window) == (
        "qwen2", True, False, None
    )  # fmt: skip
    windowed = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=16)
    assert model_spec(windowed, value_head=False).sliding_window == 16
    # from max_window_layers on (Hugging Face's layer_types), not before
    later = Qwen2Config(**SIZES, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert model_spec(later, value_head=False).window_layers == (1, 2)


def test_mistral_always_has_its_window():
    assert model_spec(MistralConfig(**SIZES, sliding_window=24), False).sliding_window == 24


def test_gpt2_spec():
    cfg = GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=48, **IDS)
    spec = model_spec(cfg, value_head=False)
    assert (spec.family, spec.hidden_size, spec.n_layers, spec.n_heads, spec.n_kv_heads) == (
        "gpt2", 32, 2, 4, 4
    )  # fmt: skip
    assert (spec.head_dim, spec.intermediate_size, spec.max_positions) == (8, 128, 48)
    assert (spec.rope_theta, spec.act, spec.norm_eps) == (None, "gelu_new", 1e-5)
    assert spec.qkv_bias and spec.o_bias and spec.mlp_bias
    assert spec.tied  # GPT-2 ties its head to the token embedding by default
    assert spec.prefix == "transformer" and spec.padding_idx is None
    assert model_spec(GPT2Config(n_embd=32, n_head=4, n_inner=50), False).intermediate_size == 50


def test_a_value_head_is_never_tied():
    cfg = LlamaConfig(**SIZES, tie_word_embeddings=True)
    assert model_spec(cfg, value_head=False).tied
    assert not model_spec(cfg, value_head=True).tied


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_rayhf_creates_is_read_back(family):
    init = ModelInit(family=family, hidden_size=32, n_layers=2, n_heads=4)
    spec = model_spec(hf_config(init, 40, 0, 2, 1), value_head=False)
    assert (spec.family, spec.vocab_size, spec.hidden_size, spec.n_layers) == (family, 40, 32, 2)
    assert not spec.tied  # rayhf's own models keep embedding and head apart


def test_an_unsupported_family_is_refused():
    with pytest.raises(RayhfError) as info:
        model_spec(SimpleNamespace(model_type="bert"), value_head=False)
    assert str(info.value) == (
        "model type 'bert' is not supported; use one of llama, qwen2, qwen3, mistral, phi3, "
        "gemma2, gemma3_text, gpt2, qwen3_moe, glm4_moe, gpt_oss, mixtral, qwen3_5_text, "
        "qwen3_next, qwen3_5_moe_text"
    )


def test_scaled_rope_takes_hugging_face_s_frequencies_and_length_dependent_rope_is_refused():
    plain = model_spec(LlamaConfig(**SIZES), value_head=False).rope_inv_freq
    assert plain is not None
    linear = LlamaConfig(**SIZES, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert model_spec(linear, False).rope_inv_freq == pytest.approx([f / 2 for f in plain])
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    scaled = model_spec(LlamaConfig(**SIZES, rope_scaling=llama3), False).rope_inv_freq
    assert (
        scaled is not None and scaled[0] == plain[0] and scaled[-1] == pytest.approx(plain[-1] / 8)
    ), "high frequencies kept, low ones divided by the factor"
    dynamic = LlamaConfig(**SIZES, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(RayhfError, match="rope_type 'dynamic' is not supported; use one of "
                       "default, linear, llama3, yarn"):  # fmt: skip
        model_spec(dynamic, value_head=False)


def test_qwen3_normalizes_each_head_s_q_and_k():
    cfg = Qwen3Config(**SIZES, head_dim=8)
    spec = model_spec(cfg, value_head=False)
    assert spec.family == "qwen3" and spec.traits.qk_norm and not spec.qkv_bias
    names = {p.name for p in param_shards(spec)}
    assert {
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.0.self_attn.k_norm.weight",
    } <= names
    assert names == set(build_model(cfg, value_head=False).state_dict())


def test_qwen3_moe_layers_off_the_sparse_step_or_listed_stay_dense():
    experts = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    cfg = Qwen3MoeConfig(**SIZES, **experts, mlp_only_layers=[1], norm_topk_prob=True)
    spec = model_spec(cfg, value_head=False)
    assert spec.moe_layers == (0, 2)
    assert spec.moe == MoESpec(n_experts=8, top_k=2, expert_size=16, renormalize=True)
    every_other = model_spec(Qwen3MoeConfig(**SIZES, decoder_sparse_step=2), value_head=False)
    assert every_other.moe_layers == (1,)


def test_mixtral_renormalizes_always_and_router_noise_is_refused():
    spec = model_spec(MixtralConfig(**SIZES, num_local_experts=4), value_head=False)
    assert spec.moe is not None and spec.moe.renormalize and spec.moe.expert_size == 72
    assert spec.moe_layers == (0, 1, 2)
    with pytest.raises(RayhfError, match=r"^router_jitter_noise: .* set it to 0"):
        model_spec(MixtralConfig(**SIZES, router_jitter_noise=0.1), value_head=False)
