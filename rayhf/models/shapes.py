"""Public model shapes for planning at scale (configs only; no weights are involved).

Sizes from the models' published ``config.json`` files: Llama-2 7B/13B/70B
(meta-llama/Llama-2-{7,13,70}b-hf) and CodeLlama-34B (codellama/CodeLlama-34b-hf).
"""

from __future__ import annotations

from dataclasses import replace

from rayhf.errors import RayhfError
from rayhf.models.spec import ModelSpec


def _llama(hidden: int, layers: int, heads: int, kv: int, inter: int, positions: int) -> ModelSpec:
    return ModelSpec(
        family="llama",
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


PUBLIC_SHAPES: dict[str, ModelSpec] = {
    "llama2-7b": _llama(4096, 32, 32, 32, 11008, 4096),
    "llama2-13b": _llama(5120, 40, 40, 40, 13824, 4096),
    "codellama-34b": _llama(8192, 48, 64, 8, 22016, 16384),
    "llama2-70b": _llama(8192, 80, 64, 8, 28672, 4096),
}


def public_shape(name: str, value_head: bool = False) -> ModelSpec:
    """A public model's shape, as an LM or (``value_head``) as a critic/reward model."""
    if name not in PUBLIC_SHAPES:
        raise RayhfError(f"model shape '{name}' is unknown; use one of {', '.join(PUBLIC_SHAPES)}")
    return replace(PUBLIC_SHAPES[name], value_head=value_head)
