"""The shape of a supported Hugging Face model, read once from its config.

Everything that shards, stages or runs a model reads a ``ModelSpec`` rather than the Hugging
Face config: its sizes and numbers (norm epsilon, RoPE frequencies, window, soft-caps) read here,
and its family's row of traits (``rayhf.models.families``: parameter names, fused weights, norm
kind and placement), which it carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayhf.errors import RayhfError
from rayhf.models.families import FamilyTraits, family_traits, text_tower

# RoPE variants whose frequencies are fixed at load (Hugging Face computes them the same way);
# "dynamic" and "longrope" change with the sequence length and are refused.
STATIC_ROPE = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class MoESpec:
    """A Mixture-of-Experts model's expert numbers (its routing kind: ``traits.moe``)."""

    n_experts: int
    top_k: int  # experts per token
    expert_size: int  # one expert's intermediate width
    renormalize: bool  # the k weights are divided by their sum
    shared_size: int = 0  # the shared experts' MLP width (0: none)
    scaling: float = 1.0  # routing weights times this (GLM-4.5's routed_scaling_factor)
    n_group: int = 1  # sigmoid routing: experts in this many groups, the best topk_group kept
    topk_group: int = 1
    limit: float = 0.0  # a clamped SwiGLU's clamp (gpt-oss's swiglu_limit)
    alpha: float = 0.0  # and its sigmoid's slope (swiglu_alpha)


@dataclass(frozen=True)
class DeltaNetSpec:
    """A hybrid model's Gated DeltaNet numbers (its layers: ``ModelSpec.delta_layers``)."""

    n_key_heads: int
    n_value_heads: int  # a multiple of the key heads: each key head serves a run of them
    key_dim: int
    value_dim: int
    conv_kernel: int  # the causal convolution's width (it keeps kernel - 1 inputs of state)

    @property
    def conv_channels(self) -> int:
        """q|k|v, the channels the convolution mixes."""
        return 2 * self.n_key_heads * self.key_dim + self.n_value_heads * self.value_dim


@dataclass(frozen=True)
class Lora:
    """LoRA adapters (``rayhf.models.lora``) of rank ``rank`` on the linear layers of the decoder
    layers whose module names are ``targets`` or end with ``.{target}`` (PEFT's
    ``target_modules`` as a list); every other weight frozen but the modules named by
    ``trains`` (PEFT's ``modules_to_save``: a critic's value head); ``dropout``: of an
    adapter's input, in training only (PEFT's ``lora_dropout``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    trains: tuple[str, ...] = ()
    dropout: float = 0.0

    @property
    def scale(self) -> float:
        """What an adapter's term is scaled by: ``alpha / rank`` (rsLoRA: ``/ sqrt(rank)``)."""
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)

    def adapts(self, module: str) -> bool:
        return module_named(module, self.targets)

    def trains_whole(self, weight: str) -> bool:
        """Whether parameter ``weight`` trains in full (its module is one of ``trains``)."""
        return module_named(weight.rsplit(".", 1)[0], self.trains)


def module_named(module: str, names: tuple[str, ...]) -> bool:
    """Whether ``module`` is one of ``names`` or ends with ``.{name}`` (PEFT's matching)."""
    return any(module == t or module.endswith(f".{t}") for t in names)


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and family traits of one causal LM (+ scalar head when ``value_head``)."""

    family: str  # its Hugging Face model type, a key of rayhf.models.families.FAMILIES
    traits: FamilyTraits  # that family's row
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
    # The layers the sliding window applies to (None: every layer; Gemma alternates) and, when
    # they rotate at other frequencies (Gemma 3), their RoPE.
    window_layers: tuple[int, ...] | None = None
    rope_inv_freq_local: tuple[float, ...] | None = None
    rope_scale_local: float = 1.0
    # Where the family has them (``traits.embed_scaled``, ``traits.query_scalar_and_softcaps``):
    # embeddings times sqrt(hidden), attention scaled by query_pre_attn_scalar ** -0.5, and
    # tanh soft-capping of attention scores and final logits (Gemma 2).
    embed_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # The role's numerics, as the planner prices them (rayhf.models.precision): bytes of its
    # compute dtype (0: the cluster device's), and fp32 weights even where it does not train
    # (a moving-average role blends into them).
    dtype_bytes: int = 0
    master: bool = False
    # Mixture-of-Experts feed-forward layers (None: every MLP dense) and which layers they are
    moe: MoESpec | None = None
    moe_layers: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm over each head's q and k (the family's, or its config's flag)
    # Gated DeltaNet layers (None: none) and which layers they are
    delta_net: DeltaNetSpec | None = None
    delta_layers: tuple[int, ...] = ()
    lora: Lora | None = None  # adapters beside the weights, which alone train (None: none)

    @property
    def prefix(self) -> str:
        """Where the backbone's parameters live in the Hugging Face state dict."""
        return self.traits.prefix

    @property
    def head_name(self) -> str:
        return "score.weight" if self.value_head else "lm_head.weight"


def _default_inv_freq(theta: float, head_dim: int) -> tuple[float, ...]:
    """Plain RoPE frequencies, as Hugging Face's default rotary embedding computes them."""
    import torch

    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return tuple((1.0 / (theta**exponents)).tolist())


def model_spec(config: Any, value_head: bool) -> ModelSpec:
    """The spec of a Hugging Face config (a released multimodal checkpoint's: its text
    tower's); unsupported families or features are refused."""
    config = text_tower(config)
    family = config.model_type
    traits = family_traits(family)
    if value_head and not traits.value_head_class:
        raise RayhfError(
            f"model type '{family}' has no sequence-classification class in transformers, so it "
            "cannot be a critic or reward model; give that role another family"
        )
    names = traits.config_names
    hidden, n_heads = getattr(config, names.hidden_size), getattr(config, names.n_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // n_heads
    n_kv_heads = getattr(config, names.n_kv_heads) if names.n_kv_heads is not None else None
    attention_bias = traits.all_biases or bool(getattr(config, "attention_bias", False))
    return ModelSpec(
        family=family,
        traits=traits,
        vocab_size=config.vocab_size,
        hidden_size=hidden,
        n_layers=getattr(config, names.n_layers),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads or n_heads,
        head_dim=head_dim,
        intermediate_size=getattr(config, names.intermediate_size) or 4 * hidden,
        max_positions=getattr(config, names.max_positions),
        norm_eps=getattr(config, names.norm_eps),
        act=next(a for a in (getattr(config, n, None) for n in names.act) if a),
        qkv_bias=traits.qkv_bias or attention_bias,
        o_bias=attention_bias and traits.o_bias,
        qk_norm=traits.qk_norm
        or bool(traits.qk_norm_flag and getattr(config, traits.qk_norm_flag, False)),
        mlp_bias=traits.all_biases or bool(getattr(config, "mlp_bias", False)),
        tied=bool(getattr(config, "tie_word_embeddings", False)) and not value_head,
        value_head=value_head,
        padding_idx=getattr(config, "pad_token_id", None) if traits.pad_row_frozen else None,
        **_rope_fields(config, traits, head_dim),
        **_window_fields(config, traits),
        **_scale_and_cap_fields(config, traits, hidden),
        **_moe_fields(config, traits),
        **_delta_fields(config, traits),
    )


def _rope_fields(config: Any, traits: FamilyTraits, head_dim: int) -> dict[str, Any]:
    """RoPE's ``ModelSpec`` fields (none with learned positions)."""
    if not traits.rope:
        return {"rope_theta": None}
    rope = getattr(config, "rope_parameters", None) or {}
    if traits.rope_per_layer_type:  # one RoPE for full-attention layers, one for sliding
        inv_freq, scale, theta = _rope(config, rope["full_attention"], head_dim, "full_attention")
        local, local_scale, _ = _rope(
            config, rope["sliding_attention"], head_dim, "sliding_attention"
        )
    else:
        inv_freq, scale, theta = _rope(config, rope, head_dim)
        local, local_scale = None, 1.0
    return {
        "rope_theta": float(theta),
        "rope_inv_freq": inv_freq,
        "rope_scale": float(scale),
        "rope_inv_freq_local": local,
        "rope_scale_local": float(local_scale),
    }


def _window_fields(config: Any, traits: FamilyTraits) -> dict[str, Any]:
    """The sliding window and the layers it applies to (``layer_types``: alternating)."""
    window, window_layers = None, None
    if traits.always_windowed or getattr(config, "use_sliding_window", False):
        window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if window is not None and types is not None:  # alternating sliding and full attention
        window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    return {"sliding_window": window, "window_layers": window_layers}


def _scale_and_cap_fields(config: Any, traits: FamilyTraits, hidden: int) -> dict[str, Any]:
    """The embedding scale, attention scale and soft-caps where the family has them."""
    out: dict[str, Any] = {}
    if traits.embed_scaled:
        out["embed_scale"] = float(hidden**0.5)
    if traits.query_scalar_and_softcaps:
        out["attn_scale"] = float(config.query_pre_attn_scalar) ** -0.5
        out["attn_softcap"] = getattr(config, "attn_logit_softcapping", None)
        out["final_softcap"] = getattr(config, "final_logit_softcapping", None)
    return out


def _moe_fields(config: Any, traits: FamilyTraits) -> dict[str, Any]:
    """The experts' numbers and the layers that route to them (none for a dense family)."""
    moe = traits.moe
    if moe is None:
        return {}
    if getattr(config, "router_jitter_noise", 0.0):
        raise RayhfError(
            "router_jitter_noise: rayhf routes tokens without noise (log-probs must reproduce); "
            "set it to 0 in the model's config.json"
        )
    renorm = moe.renormalize
    n_layers = getattr(config, traits.config_names.n_layers)
    dense: set[int] = set()
    if moe.dense_layers == "sparse_step":
        step = getattr(config, "decoder_sparse_step", 1)
        only = set(getattr(config, "mlp_only_layers", None) or ())
        dense = {i for i in range(n_layers) if i in only or (i + 1) % step}
    elif moe.dense_layers == "first_k":
        dense = set(range(getattr(config, "first_k_dense_replace", 0)))
    width = getattr(config, moe.expert_size)
    shared = 0
    if moe.shared_experts:
        shared = getattr(config, moe.shared_width) if moe.shared_width else (
            getattr(config, "n_shared_experts", 0) * width
        )  # fmt: skip
    spec = MoESpec(
        n_experts=getattr(config, moe.n_experts),
        top_k=config.num_experts_per_tok,
        expert_size=width,
        renormalize=bool(getattr(config, renorm) if isinstance(renorm, str) else renorm),
        shared_size=shared,
        scaling=float(getattr(config, "routed_scaling_factor", 1.0) or 1.0),
        n_group=getattr(config, "n_group", 1) or 1,
        topk_group=getattr(config, "topk_group", 1) or 1,
        limit=float(getattr(config, "swiglu_limit", 0.0) or 0.0),
        alpha=float(getattr(config, "swiglu_alpha", 0.0) or 0.0),
    )
    return {"moe": spec, "moe_layers": tuple(i for i in range(n_layers) if i not in dense)}


def _delta_fields(config: Any, traits: FamilyTraits) -> dict[str, Any]:
    """The Gated DeltaNet numbers and the layers that have one (none for other families)."""
    if traits.delta_net is None:
        return {}
    spec = DeltaNetSpec(
        n_key_heads=config.linear_num_key_heads,
        n_value_heads=config.linear_num_value_heads,
        key_dim=config.linear_key_head_dim,
        value_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
    )
    if spec.n_value_heads % spec.n_key_heads:
        raise RayhfError(
            f"linear_num_value_heads={spec.n_value_heads} is not a multiple of "
            f"linear_num_key_heads={spec.n_key_heads}; fix the model's config.json"
        )
    kind = traits.delta_net.layer_type
    layers = tuple(i for i, t in enumerate(config.layer_types) if t == kind)
    return {"delta_net": spec, "delta_layers": layers}


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
