"""The shape of a supported Hugging Face model, read once from its config.

Everything that shards, stages or runs a model reads a ``ModelSpec`` rather than the Hugging
Face config, so the families (Llama, including Llama 3.x's scaled RoPE; Qwen2; Qwen3, with its
per-head q/k norms; Mistral; Phi-3, with fused q|k|v and gate|up weights and partial RoPE;
Gemma 2 and 3, with soft-capping, sandwich norms and alternating sliding-window layers; GPT-2)
differ in one place: here (sizes, norms, position encoding, biases) and in ``sharding``
(parameter names and split dims).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rayhf.errors import RayhfError

Family = Literal["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt2"]
FAMILIES: tuple[str, ...] = (
    "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text", "gpt2"
)  # fmt: skip
GEMMAS = ("gemma2", "gemma3_text")
# RoPE variants whose frequencies are fixed at load (Hugging Face computes them the same way);
# "dynamic" and "longrope" change with the sequence length and are refused.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and per-family switches of one causal LM (+ scalar head when ``value_head``)."""

    family: Family
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    act: str  # a key of rayhf.parallel.model.ACTIVATIONS (Hugging Face's hidden_act names)
    rope_theta: float | None  # None = learned absolute positions (GPT-2)
    qkv_bias: bool  # q/k/v projections have a bias
    o_bias: bool  # attention output projection has a bias
    mlp_bias: bool
    sliding_window: int | None  # keys further back than this are masked (Mistral)
    tied: bool  # the LM head is the token embedding
    value_head: bool  # a ``score`` head with one output instead of the LM head
    padding_idx: int | None = None  # this embedding row gets no gradient (Hugging Face's Llama)
    # RoPE frequencies per dim pair (scaled); fewer pairs than head_dim / 2: the first dims
    # rotate and the rest pass (Phi-3's partial_rotary_factor)
    rope_inv_freq: tuple[float, ...] | None = None
    rope_scale: float = 1.0  # cos and sin multiplier (YaRN's attention factor)
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)
    # The layers the sliding window applies to (None: every layer; Gemma alternates) and, when
    # they rotate at other frequencies (Gemma 3), their RoPE.
    window_layers: tuple[int, ...] | None = None
    rope_inv_freq_local: tuple[float, ...] | None = None
    rope_scale_local: float = 1.0
    # Gemma: norms scale by (1 + weight) in fp32, a norm after attention and around the MLP,
    # embeddings times sqrt(hidden), attention scaled by query_pre_attn_scalar ** -0.5, and
    # tanh soft-capping of attention scores and final logits (Gemma 2).
    gemma: bool = False
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # The role's numerics, as the planner prices them (rayhf.models.precision): bytes of its
    # compute dtype (0: the cluster device's), and fp32 weights even where it does not train
    # (a moving-average role blends into them).
    dtype_bytes: int = 0
    master: bool = False

    @property
    def prefix(self) -> str:
        """Where the backbone's parameters live in the Hugging Face state dict."""
        return "transformer" if self.family == "gpt2" else "model"

    @property
    def head_name(self) -> str:
        return "score.weight" if self.value_head else "lm_head.weight"


def _default_inv_freq(theta: float, head_dim: int) -> tuple[float, ...]:
    """Plain RoPE frequencies, as Hugging Face's default rotary embedding computes them."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return tuple((1.0 / (theta**exponents)).tolist())


def model_spec(config: Any, value_head: bool) -> ModelSpec:
    """The spec of a Hugging Face config; unsupported families or features are refused."""
    family = config.model_type
    if family not in FAMILIES:
        raise RayhfError(
            f"model type '{family}' is not supported; use one of {', '.join(FAMILIES)}"
        )
    tied = bool(getattr(config, "tie_word_embeddings", False)) and not value_head
    if family == "gpt2":
        hidden = config.n_embd
        return ModelSpec(
            family="gpt2",
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            n_layers=config.n_layer,
            n_heads=config.n_head,
            n_kv_heads=config.n_head,
            head_dim=hidden // config.n_head,
            intermediate_size=config.n_inner or 4 * hidden,
            max_positions=config.n_positions,
            norm_eps=config.layer_norm_epsilon,
            act=config.activation_function,
            rope_theta=None,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            sliding_window=None,
            tied=tied,
            value_head=value_head,
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    gemma = family in GEMMAS
    if "full_attention" in rope:  # Gemma 3: one RoPE for full-attention layers, one for sliding
        inv_freq, rope_scale, theta = _rope(
            config, rope["full_attention"], head_dim, "full_attention"
        )
        local, local_scale, _ = _rope(
            config, rope["sliding_attention"], head_dim, "sliding_attention"
        )
    else:
        inv_freq, rope_scale, theta = _rope(config, rope, head_dim)
        local, local_scale = None, 1.0
    attention_bias = bool(getattr(config, "attention_bias", False))
    window, window_layers = None, None
    if family in ("mistral", "phi3", *GEMMAS) or getattr(config, "use_sliding_window", False):
        window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is not None and types is not None:  # alternating sliding and full attention
        window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return ModelSpec(
        family=family,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        n_layers=config.num_hidden_layers,
        n_heads=config.num_attention_heads,
        n_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        max_positions=config.max_position_embeddings,
        norm_eps=config.rms_norm_eps,
        act=getattr(config, "hidden_activation", None) or config.hidden_act,
        rope_theta=float(theta),
        qkv_bias=family == "qwen2" or attention_bias,
        qk_norm=family in ("qwen3", "gemma3_text"),
        rope_inv_freq=inv_freq,
        rope_scale=float(rope_scale),
        o_bias=attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        sliding_window=window,
        tied=tied,
        value_head=value_head,
        padding_idx=getattr(config, "pad_token_id", None),
        window_layers=window_layers,
        rope_inv_freq_local=local,
        rope_scale_local=float(local_scale),
        gemma=gemma,
        embed_scale=float(config.hidden_size**0.5) if gemma else 1.0,
        attn_scale=float(config.query_pre_attn_scalar) ** -0.5 if gemma else None,
        attn_softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        final_softcap=getattr(config, "final_logit_softcapping", None) if gemma else None,
    )


def _rope(
    config: Any, params: dict[str, Any], head_dim: int, layer_type: str | None = None
) -> tuple[tuple[float, ...], float, float]:
    """(inverse frequencies, cos/sin scale, theta) of one RoPE setting of ``config``."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE:
        raise RayhfError(
            f"rope_type '{rope_type}' is not supported; use one of {', '.join(STATIC_ROPE)}"
        )
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return _default_inv_freq(theta, int(head_dim * (partial or 1.0))), 1.0, theta
    # scaled: Hugging Face's own computation of the frequencies and attention factor (imported
    # here: a worker gets its spec from the driver and never imports transformers)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {"layer_type": layer_type} if layer_type is not None else {}
    freqs, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kw)
    return tuple(freqs.tolist()), scale, theta
