"""How every parameter of a supported model splits under tp and groups into pp stages.

This is data, kept in one place: the parallel runtime reads it to build each rank's shard, and
reallocation reads it to know which slice of a parameter lives on which device. Names come from
the family's traits (``ModelSpec.traits``: prefix, block kind, fused weights, norms).

- tp: a ``ParamShard`` names the tensor dim that splits (``tp_dim``), or None for a replicated
  parameter (norms, biases added after a row-parallel reduce, GPT-2's position table, the value
  head). Column-parallel weights split their output dim, row-parallel ones their input dim (GPT-2's
  ``Conv1D`` stores weights as ``[in, out]``, so its dims are the other way round). Embedding and
  LM head split the vocabulary. A fused parameter (GPT-2's ``c_attn`` = q|k|v, Phi-3's
  ``qkv_proj`` and ``gate_up_proj``) splits each of its ``blocks`` and concatenates the pieces,
  so a rank holds whole heads of q, k and v (and the same columns of gate and up).
  Chunks follow ``torch.tensor_split``: sizes differ by at most one (an odd vocabulary is fine);
  head dims are checked to divide evenly in ``check_layout``.
- pp: parameters belong to *units*: 0 = embeddings, 1..L = decoder layers, L+1 = final norm and
  head. ``stage_layers`` cuts the layers into contiguous stages balanced by parameter count,
  stage 0 holding the embeddings and the last stage the head.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import torch

from rayhf.errors import RayhfError
from rayhf.models.spec import ModelSpec


@dataclass(frozen=True)
class ParamShard:
    """One Hugging Face parameter: its shape, its tp split, and its pp unit."""

    name: str  # the Hugging Face state-dict key
    shape: tuple[int, ...]
    tp_dim: int | None  # None = every tp rank holds all of it
    unit: int  # 0 embeddings, 1..n_layers decoder layers, n_layers + 1 final norm + head
    blocks: tuple[int, ...] = ()  # sizes along tp_dim that split separately (q|k|v); () = one
    expert: bool = False  # routed experts stacked on dim 0 (a token multiplies top_k of them)
    trained: bool = True  # False: a weight the model reads and never steps (a router's bias)
    frozen: bool = False  # a LoRA role's base weight: it never changes in a run (moves skip it)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        assert self.tp_dim is not None
        return self.blocks or (self.shape[self.tp_dim],)


def _llama_layer(spec: ModelSpec, i: int) -> list[ParamShard]:
    h = spec.hidden_size
    inter, unit, p = spec.intermediate_size, i + 1, layer_prefix(spec, i)
    fused = spec.traits.fused_projections  # q|k|v and gate|up in one weight each
    out = [ParamShard(f"{p}.input_layernorm.weight", (h,), None, unit)]
    if i in spec.delta_layers:
        out += _delta_net(spec, f"{p}.linear_attn", unit)
    else:
        out += _attention(spec, f"{p}.self_attn", unit)
    out.append(ParamShard(f"{p}.post_attention_layernorm.weight", (h,), None, unit))
    if spec.traits.sandwich_norms:  # norms before and after the MLP too
        out += [
            ParamShard(f"{p}.pre_feedforward_layernorm.weight", (h,), None, unit),
            ParamShard(f"{p}.post_feedforward_layernorm.weight", (h,), None, unit),
        ]
    if i in spec.moe_layers:
        out += _moe_mlp(spec, f"{p}.mlp", unit)
    elif fused:
        out += [
            ParamShard(f"{p}.mlp.gate_up_proj.weight", (2 * inter, h), 0, unit, (inter, inter)),
            ParamShard(f"{p}.mlp.down_proj.weight", (h, inter), 1, unit),
        ]
    else:
        out += _dense_mlp(f"{p}.mlp", h, inter, unit)
    if i not in spec.delta_layers:
        out += _attention_extras(spec, f"{p}.self_attn", unit)
    if spec.mlp_bias and i not in spec.moe_layers:
        out += [
            ParamShard(f"{p}.mlp.gate_proj.bias", (inter,), 0, unit),
            ParamShard(f"{p}.mlp.up_proj.bias", (inter,), 0, unit),
            ParamShard(f"{p}.mlp.down_proj.bias", (h,), None, unit),
        ]
    return out


def _attention(spec: ModelSpec, a: str, unit: int) -> list[ParamShard]:
    """An attention block's projections under module ``a``: q, k, v column-parallel (whole
    heads; a gated q's rows hold each head's query, then its gate), o row-parallel."""
    h, qkv = spec.hidden_size, _qkv_sizes(spec)
    if spec.traits.fused_projections:
        out = [ParamShard(f"{a}.qkv_proj.weight", (sum(qkv), h), 0, unit, qkv)]
    else:
        out = [
            ParamShard(f"{a}.{x}_proj.weight", (n, h), 0, unit)
            for x, n in zip("qkv", qkv, strict=True)
        ]
    return [*out, ParamShard(f"{a}.o_proj.weight", (h, spec.n_heads * spec.head_dim), 1, unit)]


def _qkv_sizes(spec: ModelSpec) -> tuple[int, int, int]:
    """Rows of q (with a gate: twice the heads' dims), k and v."""
    q_out, kv_out = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    return (q_out * (2 if spec.traits.attn_output_gate else 1), kv_out, kv_out)


def _attention_extras(spec: ModelSpec, a: str, unit: int) -> list[ParamShard]:
    """An attention block's norms, biases and sinks (listed after the layer's MLP)."""
    h, d, qkv = spec.hidden_size, spec.head_dim, _qkv_sizes(spec)
    out = []
    if spec.qk_norm:  # one weight per head dim, shared by every head: replicated
        out += [
            ParamShard(f"{a}.q_norm.weight", (d,), None, unit),
            ParamShard(f"{a}.k_norm.weight", (d,), None, unit),
        ]
    if spec.qkv_bias:
        out += [
            ParamShard(f"{a}.{x}_proj.bias", (n,), 0, unit) for x, n in zip("qkv", qkv, strict=True)
        ]
    if spec.o_bias:
        out.append(ParamShard(f"{a}.o_proj.bias", (h,), None, unit))
    if spec.traits.sinks:  # one per query head: split with the heads
        out.append(ParamShard(f"{a}.sinks", (spec.n_heads,), 0, unit))
    return out


def _delta_net(spec: ModelSpec, a: str, unit: int) -> list[ParamShard]:
    """A Gated DeltaNet block's weights under module ``a``, split by heads: q|k|v (and the
    convolution's channels, which are theirs) by key heads and value heads alike, z, b, a and
    the per-head decay numbers by value heads, ``out_proj`` row-parallel; the gated norm's
    weight (one per value dim, shared by every head) whole on every rank."""
    net, h = spec.delta_net, spec.hidden_size
    assert net is not None and spec.traits.delta_net is not None
    qkv = (net.n_key_heads * net.key_dim,) * 2 + (net.n_value_heads * net.value_dim,)
    width, heads = qkv[2], net.n_value_heads
    if spec.traits.delta_net.fused:  # grouped by key head: a rank's rows are its heads' all
        projections = [
            ParamShard(f"{a}.in_proj_qkvz.weight", (sum(qkv) + width, h), 0, unit),
            ParamShard(f"{a}.in_proj_ba.weight", (2 * heads, h), 0, unit),
        ]
    else:
        projections = [
            ParamShard(f"{a}.in_proj_qkv.weight", (sum(qkv), h), 0, unit, qkv),
            ParamShard(f"{a}.in_proj_z.weight", (width, h), 0, unit),
            ParamShard(f"{a}.in_proj_b.weight", (heads, h), 0, unit),
            ParamShard(f"{a}.in_proj_a.weight", (heads, h), 0, unit),
        ]
    return [
        *projections,
        ParamShard(f"{a}.conv1d.weight", (sum(qkv), 1, net.conv_kernel), 0, unit, qkv),
        ParamShard(f"{a}.dt_bias", (heads,), 0, unit),
        ParamShard(f"{a}.A_log", (heads,), 0, unit),
        ParamShard(f"{a}.norm.weight", (net.value_dim,), None, unit),
        ParamShard(f"{a}.out_proj.weight", (h, width), 1, unit),
    ]


def _dense_mlp(m: str, h: int, inter: int, unit: int) -> list[ParamShard]:
    """A gated MLP's weights under module ``m``: gate and up column-parallel, down row-parallel."""
    return [
        ParamShard(f"{m}.gate_proj.weight", (inter, h), 0, unit),
        ParamShard(f"{m}.up_proj.weight", (inter, h), 0, unit),
        ParamShard(f"{m}.down_proj.weight", (h, inter), 1, unit),
    ]


def _moe_mlp(spec: ModelSpec, m: str, unit: int) -> list[ParamShard]:
    """A Mixture-of-Experts layer's weights under module ``m``: the router (whole on every
    rank), the experts stacked (``ExpertForm``: gate|up as one, split by tp into each rank's
    intermediate units, down by its input), and the shared experts as a dense MLP. gpt-oss's
    gate|up bias goes with its expert; its down bias, added after the sum over tp, stays whole
    on every rank."""
    moe, traits, h = spec.moe, spec.traits.moe, spec.hidden_size
    assert moe is not None and traits is not None
    e, w, r = moe.n_experts, moe.expert_size, f"{m}.{traits.router_module}"
    out = [ParamShard(f"{r}.weight", (e, h), None, unit)]
    if traits.router == "sigmoid_grouped":
        out.append(ParamShard(f"{r}.e_score_correction_bias", (e,), None, unit, trained=False))
    if traits.router == "topk_softmax":
        out.append(ParamShard(f"{r}.bias", (e,), None, unit))
    if traits.form == "clamped_swiglu":  # [E, in, out], gate and up interleaved
        out += [
            ParamShard(f"{m}.experts.gate_up_proj", (e, h, 2 * w), 2, unit, expert=True),
            ParamShard(f"{m}.experts.gate_up_proj_bias", (e, 2 * w), 1, unit, expert=True),
            ParamShard(f"{m}.experts.down_proj", (e, w, h), 1, unit, expert=True),
            ParamShard(f"{m}.experts.down_proj_bias", (e, h), None, unit),
        ]
        return out
    out += [
        ParamShard(f"{m}.experts.gate_up_proj", (e, 2 * w, h), 1, unit, (w, w), expert=True),
        ParamShard(f"{m}.experts.down_proj", (e, h, w), 2, unit, expert=True),
    ]
    if moe.shared_size:
        out += _dense_mlp(f"{m}.{traits.shared_module}", h, moe.shared_size, unit)
        if traits.shared_gate:
            out.append(ParamShard(f"{m}.shared_expert_gate.weight", (1, h), None, unit))
    return out


def _conv1d_layer(spec: ModelSpec, i: int) -> list[ParamShard]:
    h, inter, unit, p = spec.hidden_size, spec.intermediate_size, i + 1, layer_prefix(spec, i)
    return [
        ParamShard(f"{p}.ln_1.weight", (h,), None, unit),
        ParamShard(f"{p}.ln_1.bias", (h,), None, unit),
        ParamShard(f"{p}.attn.c_attn.weight", (h, 3 * h), 1, unit, (h, h, h)),
        ParamShard(f"{p}.attn.c_attn.bias", (3 * h,), 0, unit, (h, h, h)),
        ParamShard(f"{p}.attn.c_proj.weight", (h, h), 0, unit),
        ParamShard(f"{p}.attn.c_proj.bias", (h,), None, unit),
        ParamShard(f"{p}.ln_2.weight", (h,), None, unit),
        ParamShard(f"{p}.ln_2.bias", (h,), None, unit),
        ParamShard(f"{p}.mlp.c_fc.weight", (h, inter), 1, unit),
        ParamShard(f"{p}.mlp.c_fc.bias", (inter,), 0, unit),
        ParamShard(f"{p}.mlp.c_proj.weight", (inter, h), 0, unit),
        ParamShard(f"{p}.mlp.c_proj.bias", (h,), None, unit),
    ]


def param_shards(spec: ModelSpec) -> list[ParamShard]:
    """Every parameter of the model, in unit order."""
    v, h, last = spec.vocab_size, spec.hidden_size, spec.n_layers + 1
    out = [ParamShard(embedding_name(spec), (v, h), 0, 0)]
    positions = position_table_name(spec)
    if positions is not None:
        out.append(ParamShard(positions, (spec.max_positions, h), None, 0))
    layer = _conv1d_layer if spec.traits.block == "conv1d" else _llama_layer
    for i in range(spec.n_layers):
        out += layer(spec, i)
    norm = final_norm_name(spec)
    out.append(ParamShard(f"{norm}.weight", (h,), None, last))
    if spec.traits.norm == "layernorm":
        out.append(ParamShard(f"{norm}.bias", (h,), None, last))
    if spec.value_head:
        out.append(ParamShard("score.weight", (1, h), None, last))
    elif not spec.tied:
        out.append(ParamShard("lm_head.weight", (v, h), 0, last))
    return out if spec.lora is None else _with_adapters(spec, out)


Split = Literal["column", "row", "whole"]  # how tp splits an adapted weight's [out, in] view


@dataclass(frozen=True)
class AdapterPair:
    """The LoRA adapters of one weight (``rayhf.models.lora``): ``a`` and ``b`` as shards, and
    how tp splits the weight."""

    weight: str
    a: ParamShard
    b: ParamShard
    split: Split


def adapter_pairs(spec: ModelSpec, weights: Iterable[ParamShard]) -> list[AdapterPair]:
    """The pairs of those of ``weights`` that ``spec.lora`` adapts: 2-D weights of the decoder
    layers or an untied LM head (vocab-parallel: a column split), never routed experts or a
    router (Hugging Face's routers are no linear layers, so PEFT adapts neither). A
    column-parallel weight's B splits its rows as the weight does (blocks too), a row-parallel
    one's A its columns; a weight held whole keeps both whole."""
    lora, pairs = spec.lora, []
    assert lora is not None
    conv1d = spec.traits.block == "conv1d"  # GPT-2's Conv1D weights are [in, out]
    for p in weights:
        module = p.name.removesuffix(".weight")
        if not adaptable(spec, p) or ".lora_" in module or not lora.adapts(module):
            continue
        out_dim = 1 if conv1d and module != HEAD else 0  # (its head is a linear layer)
        n_out, n_in = p.shape[out_dim], p.shape[1 - out_dim]
        split: Split = "whole" if p.tp_dim is None else "column" if p.tp_dim == out_dim else "row"
        row, column = split == "row", split == "column"
        a = ParamShard(
            f"{module}.lora_A.weight", (lora.rank, n_in), 1 if row else None, p.unit,
            p.blocks if row else (),
        )  # fmt: skip
        b = ParamShard(
            f"{module}.lora_B.weight", (n_out, lora.rank), 0 if column else None, p.unit,
            p.blocks if column else (),
        )  # fmt: skip
        pairs.append(AdapterPair(p.name, a, b, split))
    return pairs


HEAD = "lm_head"  # an untied LM head's module: LoRA adapts it only when named (as PEFT)


def adaptable(spec: ModelSpec, p: ParamShard) -> bool:
    """Whether LoRA can adapt weight ``p``: a 2-D weight of the decoder layers, not a routed
    expert's nor a router's, nor one whose name PEFT reads as the experts' (``peft_fused``);
    or an LM head of its own (not tied to the embeddings)."""
    module = p.name.removesuffix(".weight")
    if p.name == f"{HEAD}.weight":
        return True
    if not (1 <= p.unit <= spec.n_layers and module != p.name and len(p.shape) == 2):
        return False
    moe = spec.traits.moe
    if moe is None:
        return not p.expert
    leaf = module.rsplit(".", 1)[-1]
    router = module.endswith(f".mlp.{moe.router_module}")
    return not (p.expert or router or leaf in moe.peft_fused)


def _with_adapters(spec: ModelSpec, shards: list[ParamShard]) -> list[ParamShard]:
    """``shards`` frozen (but the modules ``spec.lora.trains``), each adapted weight followed
    by its adapters."""
    assert spec.lora is not None
    lora = spec.lora
    pairs = {pair.weight: pair for pair in adapter_pairs(spec, shards)}
    out = []
    for p in shards:
        out.append(p if lora.trains_whole(p.name) else replace(p, trained=False, frozen=p.trained))
        if p.name in pairs:
            out += [pairs[p.name].a, pairs[p.name].b]
    return out


def embedding_name(spec: ModelSpec) -> str:
    """The token embedding's weight."""
    return f"{spec.prefix}.{spec.traits.embedding}.weight"


def position_table_name(spec: ModelSpec) -> str | None:
    """The learned position embedding's weight (GPT-2's); None with RoPE."""
    table = spec.traits.position_table
    return None if table is None else f"{spec.prefix}.{table}.weight"


def final_norm_name(spec: ModelSpec) -> str:
    """The final norm's module (``.weight``, and ``.bias`` for a LayerNorm)."""
    return f"{spec.prefix}.{spec.traits.final_norm}"


def layer_prefix(spec: ModelSpec, i: int) -> str:
    """Decoder layer ``i``'s module (``model.layers.3``)."""
    return f"{spec.prefix}.{spec.traits.layers}.{i}"


def chunk_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of chunk ``index`` when ``size`` splits like ``torch.tensor_split``."""
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_ranges(p: ParamShard, tp: int, tp_rank: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges along ``p.tp_dim`` that ``tp_rank`` holds (one per block)."""
    ranges, start = [], 0
    for size in p.block_sizes:
        lo, hi = chunk_bounds(size, tp, tp_rank)
        ranges.append((start + lo, start + hi))
        start += size
    return ranges


def expert_range(p: ParamShard, ep: int, ep_rank: int) -> tuple[int, int]:
    """The experts ``[start, stop)`` (dim 0) of ``p`` that ``ep_rank`` of ``ep`` holds: all of
    them unless ``p`` is a routed expert's weight."""
    return chunk_bounds(p.shape[0], ep, ep_rank) if p.expert else (0, p.shape[0])


def take_shard(
    full: torch.Tensor, p: ParamShard, tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0
) -> torch.Tensor:
    """The slice of ``full`` that ``tp_rank`` of ``tp`` (and ``ep_rank`` of ``ep``: its
    experts) holds (a copy, contiguous)."""
    if p.expert and ep > 1:
        lo, hi = expert_range(p, ep, ep_rank)
        full = full.narrow(0, lo, hi - lo)
    if p.tp_dim is None or tp == 1:
        return full.detach().clone()
    pieces = [full.narrow(p.tp_dim, lo, hi - lo) for lo, hi in shard_ranges(p, tp, tp_rank)]
    return torch.cat(pieces, dim=p.tp_dim).contiguous()


def shard_shape(
    p: ParamShard, tp: int, tp_rank: int, ep: int = 1, ep_rank: int = 0
) -> tuple[int, ...]:
    shape = list(p.shape)
    if p.expert and ep > 1:
        lo, hi = expert_range(p, ep, ep_rank)
        shape[0] = hi - lo
    if p.tp_dim is not None and tp > 1:
        shape[p.tp_dim] = sum(hi - lo for lo, hi in shard_ranges(p, tp, tp_rank))
    return tuple(shape)


def join_shards(shards: list[torch.Tensor], p: ParamShard) -> torch.Tensor:
    """The full parameter from every tp rank's shard, in tp-rank order."""
    if p.tp_dim is None or len(shards) == 1:
        return shards[0].clone()
    tp = len(shards)
    blocks: list[list[torch.Tensor]] = [[] for _ in p.block_sizes]
    for rank, shard in enumerate(shards):
        sizes = [hi - lo for lo, hi in shard_ranges(p, tp, rank)]
        for b, piece in enumerate(torch.split(shard, sizes, dim=p.tp_dim)):
            blocks[b].append(piece)
    return torch.cat([piece for block in blocks for piece in block], dim=p.tp_dim)


@functools.lru_cache(maxsize=1024)
def stage_layers(spec: ModelSpec, pp: int) -> tuple[range, ...]:
    """Contiguous decoder layers per stage, minimizing the largest stage's parameter count
    (memoized: the planner asks for every pp of every model shape, stage by stage)."""
    if pp > spec.n_layers:
        raise RayhfError(f"pp={pp} is more pipeline stages than the model's {spec.n_layers} layers")
    unit_size = unit_numels(spec, 1, 0)  # the whole model's units
    bounds = balanced_cuts(unit_size[0], list(unit_size[1:-1]), unit_size[-1], pp)
    return tuple(range(bounds[s], bounds[s + 1]) for s in range(pp))


def balanced_cuts(first: int, layers: list[int], last: int, pp: int) -> list[int]:
    """Stage boundaries ``[0, ..., len(layers)]`` cutting ``layers`` (sizes) into ``pp``
    non-empty contiguous stages that minimize the largest stage, stage 0 also holding ``first``
    and the last stage ``last``."""
    n = len(layers)
    prefix = [0]
    for s in layers:
        prefix.append(prefix[-1] + s)
    # best[k][i]: smallest max-stage size cutting layers[:i] into k stages (stage 0 + embeddings);
    # cut[k][i]: the first j (start of the k-th stage) reaching it. best[k - 1][j] grows with j
    # and the last stage's size shrinks, so the best j sits where they cross: a bisection on
    # best[k - 1][j] + prefix[j] (strictly increasing) instead of a scan over every j.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    for i in range(1, n + 1):
        best[1][i] = first + prefix[i]
    for k in range(2, pp + 1):
        rising = [b + p for b, p in zip(best[k - 1], prefix, strict=True)]
        for i in range(k, n + 1):
            total = prefix[i] + (last if (k == pp and i == n) else 0)
            j = bisect.bisect_left(rising, total, k - 1, i)  # first j: best[k-1][j] >= stage
            options: list[tuple[float, int]] = [(total - prefix[j - 1], j - 1)] if j > k - 1 else []
            if j < i:
                options.append((best[k - 1][j], j))
            best[k][i], cut[k][i] = min(options)  # ties keep the smaller j, as a scan would
    if pp == 1:
        return [0, n]
    bounds, i = [n], n
    for k in range(pp, 1, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.append(0)
    bounds.reverse()
    return bounds


def stage_units(spec: ModelSpec, pp: int, pp_rank: int) -> set[int]:
    """The units (see module doc) that stage ``pp_rank`` of ``pp`` holds."""
    layers = stage_layers(spec, pp)[pp_rank]
    units = {i + 1 for i in layers}
    if pp_rank == 0:
        units.add(0)
    if pp_rank == pp - 1:
        units.add(spec.n_layers + 1)
    return units


def check_layout(spec: ModelSpec, tp: int, pp: int, ep: int = 1, cp: int = 1) -> str | None:
    """Why ``tp x pp`` (with the experts split ``ep`` ways, each sequence ``cp`` ways) cannot
    hold this model, or None if it can."""
    if ep > 1 and spec.moe is None:
        return f"ep={ep} splits experts, and the model has none (a dense {spec.family})"
    if spec.moe is not None and spec.moe.n_experts % ep:
        return f"ep={ep} does not divide the model's {spec.moe.n_experts} experts"
    if tp > spec.n_heads:
        return f"tp={tp} is larger than the model's {spec.n_heads} attention heads"
    if spec.n_heads % tp:
        return f"tp={tp} does not divide the model's {spec.n_heads} attention heads"
    if spec.n_kv_heads % tp:
        return f"tp={tp} does not divide the model's {spec.n_kv_heads} key/value heads"
    if spec.delta_net is not None and spec.delta_net.n_key_heads % tp:
        return (
            f"tp={tp} does not divide the model's {spec.delta_net.n_key_heads} DeltaNet key heads"
        )
    if tp > spec.vocab_size or tp > spec.intermediate_size:
        return f"tp={tp} is larger than the vocabulary or the MLP width"
    if spec.moe is not None and tp > spec.moe.expert_size:
        return f"tp={tp} is larger than an expert's width ({spec.moe.expert_size})"
    if pp > spec.n_layers:
        return f"pp={pp} is more pipeline stages than the model's {spec.n_layers} layers"
    return _check_context(spec, tp, cp)


def _check_context(spec: ModelSpec, tp: int, cp: int) -> str | None:
    """Why ``cp`` ranks cannot split this model's sequences (``rayhf.parallel.context``)."""
    if cp > 1 and spec.delta_layers:
        return (
            f"cp={cp} splits each sequence, and a {spec.family} model's linear-attention layers "
            f"carry a state along it, which rayhf does not split; set cp to 1"
        )
    if (spec.n_heads // tp) % cp:
        return f"cp={cp} does not divide the {spec.n_heads // tp} attention heads of a tp rank"
    return None


def shard_numel(
    spec: ModelSpec, tp: int, pp: int, tp_rank: int, pp_rank: int, ep: int = 1,
    trained: bool = False,
) -> int:  # fmt: skip
    """Parameter elements one device holds under ``tp x pp`` and ``ep`` (a tied head's last
    stage: its own copy of the embedding too); ``trained``: only those an optimizer steps."""
    held = unit_numels(spec, tp, tp_rank, ep, trained)
    n = sum(held[u] for u in stage_units(spec, pp, pp_rank))
    frozen_embedding = (
        trained and spec.lora is not None and not spec.lora.trains_whole(embedding_name(spec))
    )
    if spec.tied and pp > 1 and pp_rank == pp - 1 and not frozen_embedding:
        lo, hi = chunk_bounds(spec.vocab_size, tp, tp_rank)
        n += (hi - lo) * spec.hidden_size
    return n


@functools.lru_cache(maxsize=1024)
def unit_numels(
    spec: ModelSpec, tp: int, tp_rank: int, ep: int = 1, trained: bool = False
) -> tuple[int, ...]:
    """Parameter elements of each unit (embeddings, layers, head) that tp rank ``tp_rank``
    holds (with experts split ``ep`` ways: an even share of them); ``trained``: only those an
    optimizer steps."""
    out = [0] * (spec.n_layers + 2)
    for p in param_shards(spec):
        if trained and not p.trained:
            continue
        n = p.numel // ep if p.expert else p.numel
        if p.tp_dim is None:
            out[p.unit] += n
        else:
            held = sum(hi - lo for lo, hi in shard_ranges(p, tp, tp_rank))
            out[p.unit] += n // p.shape[p.tp_dim] * held
    return tuple(out)
