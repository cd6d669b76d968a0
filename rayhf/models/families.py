"""Every supported model family as one row of traits: what the code reads, never a name it tests.

A family is a Hugging Face model type (``config.model_type``). Its row says what its checkpoint
looks like (state-dict names, fused weights, biases), how its layers compute (norm kind and
placement, q/k norms, sliding windows, Gemma's scalings) and how its config names its sizes.
``rayhf.models.spec`` reads a config through the row into a ``ModelSpec`` that carries it;
sharding, the sharded model, Hugging Face conversion and the parity check read the traits.

Adding a family: a row here (with the tiny shape the parity check builds of it) and nothing
else, when its layers are made of traits that exist; a new kind of layer needs its trait here
and the code that reads it (``rayhf.models.sharding`` for names and splits,
``rayhf.parallel.model`` for the forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

from rayhf.errors import RayhfError

BlockKind = Literal["llama", "conv1d"]
"""``llama``: Llama-style decoder layers (``{prefix}.layers.{i}.self_attn.q_proj``, ``mlp.
gate_proj``, ..., weights ``[out, in]``); ``conv1d``: GPT-2's (``{prefix}.h.{i}.attn.c_attn``
holding q|k|v, ``mlp.c_fc``, ..., ``Conv1D`` weights ``[in, out]``)."""

NormKind = Literal["rmsnorm", "layernorm"]
"""``rmsnorm``: a weight only; ``layernorm``: a weight and a bias (GPT-2)."""


@dataclass(frozen=True)
class ConfigNames:
    """The Hugging Face config's names for a model's sizes."""

    hidden_size: str
    n_layers: str
    n_heads: str
    n_kv_heads: str | None  # None: as many key/value heads as query heads
    intermediate_size: str
    max_positions: str
    norm_eps: str
    act: tuple[str, ...]  # the first one set names the activation
    zeroed: tuple[str, ...] = ()  # dropouts a created config sets to 0 (log-probs reproduce)


LLAMA_NAMES = ConfigNames(
    hidden_size="hidden_size",
    n_layers="num_hidden_layers",
    n_heads="num_attention_heads",
    n_kv_heads="num_key_value_heads",
    intermediate_size="intermediate_size",
    max_positions="max_position_embeddings",
    norm_eps="rms_norm_eps",
    act=("hidden_activation", "hidden_act"),
)
GPT2_NAMES = ConfigNames(
    hidden_size="n_embd",
    n_layers="n_layer",
    n_heads="n_head",
    n_kv_heads=None,
    intermediate_size="n_inner",
    max_positions="n_positions",
    norm_eps="layer_norm_epsilon",
    act=("activation_function",),
    zeroed=("resid_pdrop", "embd_pdrop", "attn_pdrop"),
)


RouterKind = Literal["softmax_topk", "topk_softmax", "sigmoid_grouped"]
"""``softmax_topk``: a softmax over every expert's logit in fp32, then the top k (Qwen3-MoE,
Mixtral); ``topk_softmax``: the top k logits (a router with a bias), then a softmax over them in
their dtype (gpt-oss); ``sigmoid_grouped``: sigmoid scores in fp32, the top k chosen by score plus a
score-correction bias (``gate.e_score_correction_bias``, not trained) within the best
``topk_group`` of ``n_group`` groups, weighted by the scores without it, times
``routed_scaling_factor`` (DeepSeek-V3, GLM-4.5)."""

DenseLayers = Literal["none", "sparse_step", "first_k"]
"""Which decoder layers keep a dense MLP: none; those ``mlp_only_layers`` names or off the
``decoder_sparse_step`` (Qwen3-MoE); the first ``first_k_dense_replace`` (GLM-4.5)."""

ExpertFiles = Literal["per_expert", "mixtral", "stacked"]
"""How a checkpoint on disk names the experts that the model holds stacked: one
``experts.{e}.{gate,up,down}_proj.weight`` each (Qwen3-MoE, GLM-4.5), Mixtral's
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` and ``block_sparse_moe.gate``, or stacked
as in memory (gpt-oss)."""

ExpertForm = Literal["gated", "clamped_swiglu"]
"""What an expert is: ``gated``, ``down(act(gate) * up)`` with ``gate_up_proj [E, 2I, H]`` (gate
rows, then up rows) and ``down_proj [E, H, I]``, no biases; ``clamped_swiglu``, gpt-oss's:
``gate_up_proj [E, H, 2I]`` (inputs first, gate and up columns interleaved) and ``down_proj
[E, I, H]`` with biases, ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g =
clamp(gate, max=l)`` (the config's ``swiglu_limit`` l and ``swiglu_alpha``)."""


@dataclass(frozen=True)
class MoETraits:
    """How a family's Mixture-of-Experts layers route tokens and name their experts."""

    router: RouterKind = "softmax_topk"
    expert_size: str = "moe_intermediate_size"
    """The config's name for one expert's intermediate width."""
    renormalize: bool | str = True
    """The k chosen weights are divided by their sum; a string: the config flag that says so."""
    weights_fp32: bool = False
    """Each expert's output is weighted in fp32 (Mixtral keeps the routing weights fp32)."""
    dense_layers: DenseLayers = "none"
    shared_experts: bool = False
    """An MLP every token goes through beside its routed experts, ``n_shared_experts`` experts
    wide (GLM-4.5)."""
    shared_module: str = "shared_experts"
    """That MLP's module under the layer's ``mlp`` (Qwen3-Next: ``shared_expert``)."""
    shared_width: str | None = None
    """The config's name for that MLP's width; None: ``n_shared_experts`` experts wide."""
    shared_gate: bool = False
    """That MLP's output is times the sigmoid of a one-unit linear layer of the token
    (``shared_expert_gate``: Qwen3-Next)."""
    n_experts: str = "num_local_experts"
    """The config's name for the number of routed experts."""
    files: ExpertFiles = "per_expert"
    form: ExpertForm = "gated"
    router_module: str = "gate"
    """The router's module under the layer's ``mlp`` (gpt-oss: ``router``, with a bias)."""
    peft_fused: tuple[str, ...] = ()
    """The module names PEFT reads, on this family, as its routed experts and router (their
    names before transformers 5 fused the experts): a LoRA target of one of these names adapts
    the experts in PEFT, so rayhf, which adapts no routed expert, refuses them."""


@dataclass(frozen=True)
class DeltaNetTraits:
    """A hybrid family's Gated DeltaNet layers (``layer_types``' ``linear_attention``): per
    token, a short causal convolution over q|k|v, then a gated delta-rule recurrence whose
    state per sequence is ``[v heads, key dim, value dim]``, an RMSNorm gated by ``z`` and
    ``out_proj`` (Qwen3.5: ``linear_attn.in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``)."""

    layer_type: str = "linear_attention"
    """The config's ``layer_types`` entry of such a layer."""
    fused: bool = False
    """q|k|v|z in one ``in_proj_qkvz`` and b|a in one ``in_proj_ba``, grouped by key head:
    each key head's q, k, v, z (of the value heads it serves), then its b, a (Qwen3-Next)."""


@dataclass(frozen=True)
class FamilyTraits:
    """What one model family is. Defaults: a Llama-style decoder with plain RoPE."""

    hf_config_class: str
    """Its config class in ``transformers`` (imported by name where a config is created)."""
    config_names: ConfigNames = LLAMA_NAMES
    """How its config names its sizes."""
    mlp_ratio: float | None = 2.75
    """intermediate_size per hidden unit when ``init`` leaves it out; None: the config class's
    own default (GPT-2's: 4)."""

    # the checkpoint's names
    prefix: str = "model"
    """Where the backbone lives in the state dict (``transformer`` for GPT-2)."""
    layers: str = "layers"
    """The decoder layers' list under ``prefix`` (``h`` for GPT-2)."""
    embedding: str = "embed_tokens"
    """The token embedding under ``prefix``."""
    final_norm: str = "norm"
    """The norm before the head under ``prefix``."""
    position_table: str | None = None
    """Learned absolute positions under ``prefix`` (GPT-2's ``wpe``); None: RoPE."""
    block: BlockKind = "llama"
    """The decoder layer's parameters and computation (see ``BlockKind``)."""
    fused_projections: bool = False
    """q|k|v in one ``qkv_proj`` weight and gate|up in one ``gate_up_proj`` (Phi-3)."""
    all_biases: bool = False
    """Every linear layer has a bias, whatever the config says (GPT-2)."""
    qkv_bias: bool = False
    """q/k/v projections have biases, whatever the config says (Qwen2)."""
    pad_row_frozen: bool = True
    """The embedding's ``pad_token_id`` row gets no gradient (Hugging Face's ``padding_idx``)."""

    # how the layers compute
    norm: NormKind = "rmsnorm"
    norm_adds_one: bool = False
    """RMSNorm scales by ``1 + weight`` in fp32, then casts (Gemma)."""
    sandwich_norms: bool = False
    """A norm on each block's output and one before the MLP (Gemma's four norms a layer)."""
    embed_scaled: bool = False
    """Embeddings times sqrt(hidden_size), in the table's dtype (Gemma)."""
    query_scalar_and_softcaps: bool = False
    """Attention scaled by ``query_pre_attn_scalar ** -0.5`` and the config's tanh soft-caps of
    scores and logits read (Gemma)."""
    qk_norm: bool = False
    """RMSNorm over each head's q and k before RoPE (Qwen3, Gemma 3)."""
    always_windowed: bool = False
    """The config's ``sliding_window`` applies without ``use_sliding_window`` (Mistral, Phi-3,
    Gemma); its ``layer_types`` say which layers it applies to."""
    rope_per_layer_type: bool = False
    """``rope_parameters`` hold one RoPE per layer type (Gemma 3: full and sliding attention)."""
    alternating_layer_types: bool = False
    """A created config alternates sliding and full attention layers (Gemma 3's ``layer_types``;
    Gemma 2's config alternates them itself)."""
    moe: MoETraits | None = None
    """Mixture-of-Experts feed-forward layers, routed as the row says; None: dense MLPs."""
    qk_norm_flag: str | None = None
    """The config flag that turns on the q/k norms (GLM-4.5's ``use_qk_norm``)."""
    o_bias: bool = True
    """With ``attention_bias`` the output projection has a bias too (GLM-4.5's has none)."""
    value_head_class: bool = True
    """transformers has a sequence-classification class of it: a critic or reward model."""
    sinks: bool = False
    """Each attention head has a learned logit beside its keys' in the softmax, which takes
    some of the weight and adds nothing (``self_attn.sinks``: gpt-oss)."""
    norm_weight_fp32: bool = False
    """RMSNorm multiplies its weight by the fp32 normalized input, then casts (gpt-oss)."""
    attn_output_gate: bool = False
    """``q_proj`` gives each head's query and then as many gate units: the attention output
    times their sigmoid before ``o_proj`` (Qwen3.5, Qwen3-Next)."""
    delta_net: DeltaNetTraits | None = None
    """Gated DeltaNet layers among the attention ones; None: attention everywhere."""
    released_as: str | None = None
    """The model type of the multimodal checkpoints released with this family as their text
    tower, under ``model.language_model`` beside a vision tower (and MTP heads): rayhf trains
    the tower and saves the other tensors back as it read them (Qwen3.5's ``qwen3_5``)."""
    check_randomized: tuple[str, ...] = ()
    """Parameters the parity check's tiny model refills at random (name endings): ones Hugging
    Face starts at zero, which would not bite."""

    check_shape: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The tiny model ``rayhf.checks.parity`` builds of this family (``ModelInit`` fields beside
    hidden_size 32 and 4 layers): heads and options that make each trait bite."""

    @property
    def rope(self) -> bool:
        """Positions are rotary (no learned table)."""
        return self.position_table is None


_LLAMA = FamilyTraits(
    "LlamaConfig",
    check_shape={"n_heads": 8, "n_kv_heads": 4},  # grouped-query attention
)
_GEMMA = FamilyTraits(
    "Gemma2Config",
    norm_adds_one=True,
    sandwich_norms=True,
    embed_scaled=True,
    query_scalar_and_softcaps=True,
    always_windowed=True,
    # (1 + w) norms around both blocks, scaled embeddings, alternating sliding-window layers,
    # attention scaled by query_pre_attn_scalar, scores and logits soft-capped hard enough to
    # bite, and the LM head tied to the embedding (under pp: a copy on the last stage)
    check_shape={"n_heads": 8, "n_kv_heads": 4, "sliding_window": 4, "tied": True,
                 "config": {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0,
                            "query_pre_attn_scalar": 16}},
)  # fmt: skip

# the parity check's shape of a hybrid (DeltaNet layers beside attention), shared by its rows
HYBRID_CHECK: dict[str, Any] = {
    "n_heads": 8,
    "n_kv_heads": 4,
    "rope_parameters": {"partial_rotary_factor": 0.5},
    "config": {
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
}

# Gated DeltaNet layers (three in four) with a gated full-attention layer between them,
# (1 + w) norms, q/k norms, a quarter of each head rotated; grouped heads in both kinds
_QWEN3_5 = FamilyTraits(
    "Qwen3_5TextConfig",
    norm_adds_one=True,
    qk_norm=True,
    attn_output_gate=True,
    delta_net=DeltaNetTraits(),
    released_as="qwen3_5",
    check_randomized=("norm.weight", "dt_bias"),  # (1 + w) norms start at 0
    check_shape=HYBRID_CHECK,
)
# PEFT's names for the experts and router of the families transformers converts as Qwen2-MoE
_QWEN2_MOE_PEFT = ("gate_proj", "up_proj", "down_proj", "gate")
# routed experts beside a shared expert whose output is gated by the token (Qwen3-Next's and
# Qwen3.5-MoE's)
_GATED_SHARED = MoETraits(
    shared_experts=True,
    shared_module="shared_expert",
    shared_width="shared_expert_intermediate_size",
    shared_gate=True,
    n_experts="num_experts",
)
_GATED_SHARED_CHECK = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

FAMILIES: dict[str, FamilyTraits] = {
    "llama": _LLAMA,
    "qwen2": FamilyTraits("Qwen2Config", qkv_bias=True, check_shape={"n_heads": 4}),
    "qwen3": replace(_LLAMA, hf_config_class="Qwen3Config", qk_norm=True),
    "mistral": FamilyTraits(
        "MistralConfig",
        always_windowed=True,
        check_shape={"n_heads": 8, "n_kv_heads": 4, "intermediate_size": 90},  # uneven MLP shards
    ),
    # fused q|k|v and gate|up, RoPE over half of each head, a window shorter than the rows
    "phi3": FamilyTraits(
        "Phi3Config",
        fused_projections=True,
        always_windowed=True,
        check_shape={
            "n_heads": 8,
            "n_kv_heads": 4,
            "sliding_window": 5,
            "rope_parameters": {"partial_rotary_factor": 0.5},
        },
    ),
    "gemma2": _GEMMA,
    # + q/k norms, and other RoPE on the full-attention layers (scaled) than on the sliding ones
    "gemma3_text": replace(
        _GEMMA,
        hf_config_class="Gemma3TextConfig",
        qk_norm=True,
        rope_per_layer_type=True,
        alternating_layer_types=True,
        check_shape={
            "n_heads": 8,
            "n_kv_heads": 4,
            "sliding_window": 4,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
    # fused q|k|v, Conv1D, learned positions
    "gpt2": FamilyTraits(
        "GPT2Config",
        config_names=GPT2_NAMES,
        mlp_ratio=None,
        prefix="transformer",
        layers="h",
        embedding="wte",
        final_norm="ln_f",
        position_table="wpe",
        block="conv1d",
        all_biases=True,
        pad_row_frozen=False,
        norm="layernorm",
        check_shape={"n_heads": 4},
    ),
    # experts chosen by a softmax in fp32, not renormalized (norm_topk_prob: false), a dense
    # layer among the sparse ones, q/k norms
    "qwen3_moe": replace(
        _LLAMA,
        hf_config_class="Qwen3MoeConfig",
        qk_norm=True,
        moe=MoETraits(
            renormalize="norm_topk_prob", dense_layers="sparse_step", peft_fused=_QWEN2_MOE_PEFT
        ),
        check_shape={
            "n_heads": 8,
            "n_kv_heads": 4,
            "intermediate_size": 48,
            "config": {
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "mlp_only_layers": [1],
            },
        },
    ),
    # sigmoid scores with a correction bias chosen in groups, scaled, renormalized; shared
    # experts; a dense first layer; q/k/v biases but none on o; q/k norms by flag; half RoPE
    "glm4_moe": FamilyTraits(
        "Glm4MoeConfig",
        moe=MoETraits(
            router="sigmoid_grouped",
            renormalize="norm_topk_prob",
            dense_layers="first_k",
            shared_experts=True,
            peft_fused=_QWEN2_MOE_PEFT,
        ),
        qk_norm_flag="use_qk_norm",
        o_bias=False,
        value_head_class=False,
        check_randomized=("e_score_correction_bias",),
        check_shape={
            "n_heads": 4,
            "n_kv_heads": 4,
            "intermediate_size": 48,
            "config": {
                "n_routed_experts": 8,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "n_shared_experts": 1,
                "n_group": 4,
                "topk_group": 2,
                "routed_scaling_factor": 2.5,
                "norm_topk_prob": True,
                "first_k_dense_replace": 1,
                "attention_bias": True,
                "use_qk_norm": True,
            },
        },
    ),
    # a router with a bias (softmax over the top k logits), biased interleaved experts with a
    # clamped SwiGLU, attention sinks, q/k/v/o biases, alternating sliding-window layers, YaRN
    "gpt_oss": FamilyTraits(
        "GptOssConfig",
        always_windowed=True,
        alternating_layer_types=True,
        sinks=True,
        norm_weight_fp32=True,
        moe=MoETraits(
            router="topk_softmax",
            expert_size="intermediate_size",
            renormalize=False,
            files="stacked",
            form="clamped_swiglu",
            router_module="router",
        ),
        check_randomized=("sinks", "router.bias", "proj_bias", "_proj.bias"),
        check_shape={
            "n_heads": 4,
            "n_kv_heads": 2,
            "sliding_window": 4,
            "intermediate_size": 32,
            "config": {
                "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "swiglu_limit": 1.0,
            },
        },
    ),
    # renormalized fp32 routing weights, every layer sparse, a window
    "mixtral": FamilyTraits(
        "MixtralConfig",
        always_windowed=True,
        moe=MoETraits(
            expert_size="intermediate_size",
            weights_fp32=True,
            files="mixtral",
            peft_fused=("w1", "w2", "w3", "gate"),
        ),
        check_shape={
            "n_heads": 8,
            "n_kv_heads": 4,
            "sliding_window": 4,
            "intermediate_size": 32,
            "config": {"num_local_experts": 4, "num_experts_per_tok": 2},
        },
    ),
    "qwen3_5_text": _QWEN3_5,
    # Qwen3.5's layers with DeltaNet projections fused by key head, and Mixture-of-Experts
    # feed-forward layers (one in ``decoder_sparse_step``, but ``mlp_only_layers``)
    "qwen3_next": replace(
        _QWEN3_5,
        hf_config_class="Qwen3NextConfig",
        delta_net=DeltaNetTraits(fused=True),
        moe=replace(
            _GATED_SHARED,
            renormalize="norm_topk_prob",
            dense_layers="sparse_step",
            peft_fused=_QWEN2_MOE_PEFT,
        ),
        released_as=None,
        check_shape={
            **HYBRID_CHECK,
            "intermediate_size": 48,
            "config": {**HYBRID_CHECK["config"], **_GATED_SHARED_CHECK, "mlp_only_layers": [1]},
        },
    ),
    # Qwen3.5's layers, every feed-forward layer a Mixture of Experts (the top k renormalized)
    "qwen3_5_moe_text": replace(
        _QWEN3_5,
        hf_config_class="Qwen3_5MoeTextConfig",
        moe=_GATED_SHARED,
        value_head_class=False,  # (transformers has no sequence-classification class of it)
        released_as="qwen3_5_moe",
        # (8 experts: a routing near-tie puts tp 4's bf16 logits past the harness's bound)
        check_shape={
            **HYBRID_CHECK,
            "config": {**HYBRID_CHECK["config"], **_GATED_SHARED_CHECK, "num_experts": 4},
        },
    ),
}
"""Every supported family by Hugging Face model type, in the order messages list them."""


TOWER = "model.language_model"
"""Where a released multimodal checkpoint keeps its text tower's backbone (``released_as``)."""


def text_tower(config: Any) -> Any:
    """The config of the model rayhf runs: a released multimodal checkpoint's text tower
    (``FamilyTraits.released_as``), else ``config`` itself."""
    if any(t.released_as == config.model_type for t in FAMILIES.values()):
        return config.get_text_config()
    return config


def family_traits(family: str) -> FamilyTraits:
    """The row of ``family`` (a Hugging Face model type), or an error naming the supported
    ones."""
    if family not in FAMILIES:
        raise RayhfError(
            f"model type '{family}' is not supported; use one of {', '.join(FAMILIES)}"
        )
    return FAMILIES[family]


def register_family(name: str, traits: FamilyTraits) -> None:
    """Add a row for a family defined outside this table (a test's renamed copy of one)."""
    FAMILIES[name] = traits


def name_registered_row(config: Any, family: str) -> None:
    """Mark a config created for ``family`` whose class has another model type (a registered
    copy of a row) with the row's name, which ``model_spec`` reads. It still saves as its
    class's model type."""
    if type(config).model_type != family:
        config.model_type = family
