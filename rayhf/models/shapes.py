"""Public model shapes for planning at scale (configs only; no weights are involved).

Sizes from the models' published ``config.json`` files: Llama-2 7B/13B/70B
(meta-llama/Llama-2-{7,13,70}b-hf), CodeLlama-34B (codellama/CodeLlama-34b-hf) and Qwen2.5
0.5B/1.5B/7B (Qwen/Qwen2.5-{0.5,1.5,7}B-Instruct), Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B),
GLM-4.5-Air (zai-org/GLM-4.5-Air, as transformers' conversion script gives its config; its
multi-token-prediction layer, which RL does not train, left out).
"""

from __future__ import annotations

from dataclasses import replace

from rayhf.errors import RayhfError
from rayhf.models.families import FAMILIES
from rayhf.models.spec import ModelSpec, MoESpec


def _llama(hidden: int, layers: int, heads: int, kv: int, inter: int, positions: int) -> ModelSpec:
    return ModelSpec(
        family="llama",
        traits=FAMILIES["llama"],
        vocab_size=32000,
        hidden_size=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=inter,
        max_positions=positions,
        norm_eps=1e-5,
        act="silu",
        rope_theta=10000.0,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
        tied=False,
        value_head=False,
        padding_idx=None,
    )


def _qwen25(
    hidden: int, layers: int, heads: int, kv: int, inter: int, vocab: int, tied: bool
) -> ModelSpec:
    """Qwen2.5: biased q/k/v, RoPE base 1e6, 32k positions."""
    return replace(
        _llama(hidden, layers, heads, kv, inter, 32768),
        family="qwen2", traits=FAMILIES["qwen2"], vocab_size=vocab, norm_eps=1e-6, rope_theta=1e6,
        qkv_bias=True, tied=tied,
    )  # fmt: skip


def _qwen3_moe(hidden: int, layers: int, heads: int, kv: int, experts: int, width: int):
    """Qwen3-MoE: q/k norms, head_dim 128, every layer sparse, 8 of ``experts`` experts a token
    (not renormalized), RoPE base 1e6, 40k positions."""
    return replace(
        _llama(hidden, layers, heads, kv, 6144, 40960),
        family="qwen3_moe", traits=FAMILIES["qwen3_moe"], vocab_size=151936, head_dim=128,
        norm_eps=1e-6, rope_theta=1e6,
        moe=MoESpec(n_experts=experts, top_k=8, expert_size=width, renormalize=True),
        moe_layers=tuple(range(layers)),
    )  # fmt: skip


def _glm45_air() -> ModelSpec:
    """GLM-4.5-Air: 46 layers, the first dense, the rest 128 routed experts (8 a token, sigmoid
    routing with a correction bias) and one shared; q/k/v biases, half-width RoPE."""
    return replace(
        _llama(4096, 46, 96, 8, 10944, 131072),
        family="glm4_moe", traits=FAMILIES["glm4_moe"], vocab_size=151552, head_dim=128,
        norm_eps=1e-5, rope_theta=1e6, qkv_bias=True,
        moe=MoESpec(n_experts=128, top_k=8, expert_size=1408, renormalize=True, shared_size=1408),
        moe_layers=tuple(range(1, 46)),
    )  # fmt: skip


PUBLIC_SHAPES: dict[str, ModelSpec] = {
    "llama2-7b": _llama(4096, 32, 32, 32, 11008, 4096),
    "llama2-13b": _llama(5120, 40, 40, 40, 13824, 4096),
    "codellama-34b": _llama(8192, 48, 64, 8, 22016, 16384),
    "llama2-70b": _llama(8192, 80, 64, 8, 28672, 4096),
    "qwen2.5-0.5b": _qwen25(896, 24, 14, 2, 4864, 151936, tied=True),
    "qwen2.5-1.5b": _qwen25(1536, 28, 12, 2, 8960, 151936, tied=True),
    "qwen2.5-7b": _qwen25(3584, 28, 28, 4, 18944, 152064, tied=False),
    "qwen2.5-32b": _qwen25(5120, 64, 40, 8, 27648, 152064, tied=False),
    "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 4, 128, 768),
    "glm-4.5-air": _glm45_air(),
}


def public_shape(name: str, value_head: bool = False) -> ModelSpec:
    """A public model's shape, as an LM or (``value_head``) as a critic/reward model."""
    if name not in PUBLIC_SHAPES:
        raise RayhfError(f"model shape '{name}' is unknown; use one of {', '.join(PUBLIC_SHAPES)}")
    return replace(PUBLIC_SHAPES[name], value_head=value_head)
