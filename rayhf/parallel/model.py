"""One rank's piece of a causal LM: its pipeline stage's layers, its tensor-parallel shards.

Parameters keep their Hugging Face names (``model.layers.3.mlp.up_proj.weight``) and hold the
slice ``rayhf.models.sharding`` assigns to this rank, so checkpoints and reallocation need no
renaming. The forward pass is written once for every family (GPT-2's Conv1D blocks, and the
Llama-style blocks with the switches of the family's traits, ``ModelSpec.traits``); it mirrors
the Hugging Face modules operation by operation, so results match a single-process Hugging
Face model in the same precision to rounding (``rayhf.checks.parity``). Stage 0 maps token ids
to hidden states; the last stage maps hidden states to logits (or, with a value head, one value
per token); the stages between map hidden to hidden.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rayhf.errors import RayhfError
from rayhf.models.lora import initial
from rayhf.models.precision import Numerics
from rayhf.models.sharding import (
    AdapterPair,
    ParamShard,
    check_layout,
    chunk_bounds,
    embedding_name,
    final_norm_name,
    layer_prefix,
    param_shards,
    position_table_name,
    shard_shape,
    stage_layers,
    stage_units,
    take_shard,
)
from rayhf.models.spec import ModelSpec
from rayhf.parallel.attention import (
    KVCache,
    TokenLayout,
    apply_rotary,
    attention,
    by_rows,
    by_tokens,
    rotary,
)
from rayhf.parallel.buckets import LOGIT_CHUNK
from rayhf.parallel.context import attention_heads, to_tokens
from rayhf.parallel.delta_net import (
    causal_conv,
    conv_step,
    decays,
    fla_kernel,
    gated_delta_rule,
    gated_norm,
    history,
    packed_rule,
    rule_step,
    split_heads,
)
from rayhf.parallel.groups import ParallelGroups
from rayhf.parallel.lora import adapters_of, reduced_term, unreduced_term
from rayhf.parallel.moe import (
    Routes,
    clamped_swiglu,
    expert_counts,
    experts,
    glu,
    route,
    route_differs,
)
from rayhf.parallel.tp import copy_to_tp, gather_from_tp, reduce_from_tp

# cos and sin of a forward's positions per frequency set: the global one (False) and Gemma 3's
# local one (True)
Rotations = dict[bool, tuple[torch.Tensor, torch.Tensor]]


QKV = ("q_proj", "k_proj", "v_proj")  # a Llama-style layer's attention projections
GATE_UP = ("gate_proj", "up_proj")  # and its MLP's, before the activation


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU (``gelu_new``): the tanh approximation written out, as Hugging Face computes
    it (``F.gelu(approximate="tanh")`` rounds otherwise)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


# Hugging Face's ``hidden_act`` names, computed as its ``ACT2FN`` computes them; a table here,
# not ``transformers.activations``, whose import (the hub-kernels integration, torch._dynamo) is
# much of a worker's start (docs/decisions/0086-*).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_tanh_formula,
    "relu": F.relu,
}


def _key(name: str) -> str:
    return name.replace(".", "__")


class ShardedModel(torch.nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        groups: ParallelGroups,
        full: Mapping[str, torch.Tensor] | None,
        numerics: Numerics | None = None,
    ):
        """Keep this rank's shards of the full Hugging Face state dict ``full`` (None: zeros),
        stored and computed as ``numerics`` says (default: fp32); LoRA adapters that ``full``
        lacks start as PEFT's do (``spec.lora``: ``rayhf.parallel.lora``)."""
        super().__init__()
        self.spec, self.groups = spec, groups
        if groups.cp > 1 and (refused := check_layout(spec, groups.tp, 1, cp=groups.cp)):
            raise RayhfError(refused)
        self.numerics = numerics or Numerics()
        dtype = self.numerics.storage
        tp, c = groups.tp, groups.coords
        self.layers = stage_layers(spec, groups.pp)[c.pp_rank]
        units = stage_units(spec, groups.pp, c.pp_rank)
        # A tied head on a last stage apart from the first keeps its own copy of the embedding
        # (its gradient summed with the first stage's over ``groups.ends_group``).
        tied_copy = spec.tied and groups.is_last_stage and not groups.is_first_stage
        self.shards: dict[str, ParamShard] = {
            p.name: p
            for p in param_shards(spec)
            if p.unit in units or (tied_copy and p.name == embedding_name(spec))
        }
        self.tied_copy = tied_copy
        ep, ep_rank = groups.ep, groups.ep_rank
        for name, p in self.shards.items():
            if full is None:  # the weights arrive later (reallocation)
                local = torch.zeros(shard_shape(p, tp, c.tp_rank, ep, ep_rank), dtype=dtype)
            else:
                whole = full[name] if name in full or ".lora_" not in name else initial(p)
                local = take_shard(whole.to(dtype), p, tp, c.tp_rank, ep, ep_rank)
            self.register_parameter(_key(name), torch.nn.Parameter(local, p.trained))
        self.shard_shapes = {name: tuple(self.param(name).shape) for name in self.shards}
        self.n_heads = spec.n_heads // tp
        self.n_kv_heads = spec.n_kv_heads // tp
        self.vocab_range = chunk_bounds(spec.vocab_size, tp, c.tp_rank)
        if spec.act not in ACTIVATIONS:
            raise RayhfError(
                f"hidden_act: {spec.act!r} is not an activation rayhf runs "
                f"(one of {', '.join(ACTIVATIONS)})"
            )
        self.act = ACTIVATIONS[spec.act]
        # Activation checkpointing: in training, keep each layer's input only and run the layer
        # again in backward (its tp collectives too, in the same order on every rank).
        self.checkpointing = False
        # in training, each MoE layer's tokens per expert (``take_expert_loads``), on the device
        self.expert_loads: list[torch.Tensor] = []
        # in training with a generator's routes (``Routes.given``), per MoE layer and pass:
        # [tokens whose router chose other experts, ... that went to other experts, tokens]
        self.route_checks: list[torch.Tensor] = []
        # with ``balancing``, in training: per MoE layer and pass, the experts' picks [E], the
        # router's probabilities summed over the tokens [E] and its logsumexps' squares summed
        # (both with their graphs), and the tokens (``take_balance_losses``)
        self.balancing = False
        # with ``balances_bias``, in training: each sigmoid-routed MoE layer's tokens per
        # expert since the last ``update_correction_biases``
        self.balances_bias = False
        self.layer_loads: dict[str, torch.Tensor] = {}
        self.router_sums: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        self.moe_index = {layer: j for j, layer in enumerate(spec.moe_layers)}
        self._freqs: dict[tuple[bool, str], torch.Tensor] = {}
        self.version = 0  # bumped by whoever changes the weights (``RankModel.changed``)
        self.lent: dict[str, torch.Tensor] | None = None  # see ``reading_lent``
        self.lent_merged = False  # the lent weights hold the LoRA adapters merged in
        # GPT-2's blocks keep their matmul weights [in, out] (Conv1D); None: every one [out, in]
        conv1d = spec.traits.block == "conv1d"
        self.conv1d_prefix = f"{spec.prefix}.{spec.traits.layers}." if conv1d else None
        # LoRA: each adapted weight's adapters (by the weight's name), applied unmerged
        self.adapters = {} if spec.lora is None else adapters_of(self)
        self.adapters_on = True  # False: the base weights alone (``base_weights``)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def param(self, name: str) -> torch.Tensor:
        """This rank's shard of parameter ``name`` (a Hugging Face name)."""
        return getattr(self, _key(name))

    def param_or_none(self, name: str) -> torch.Tensor | None:
        """``param(name)``, or None where the model has no such parameter (a bias)."""
        return getattr(self, _key(name), None)

    def matmul_weights(self) -> list[str]:
        """The weights matmuls read (``matmul``): every 2-D weight but the embedding lookups
        (the embedding too when the LM head is tied to it)."""
        lookups = {position_table_name(self.spec)}
        if not self.spec.tied:
            lookups.add(embedding_name(self.spec))
        return [
            n
            for n in self.shards
            if self.param(n).dim() == 2 and n not in lookups and not n.endswith("proj_bias")
        ]  # (gpt-oss's expert biases are 2-D)

    def lendable(self) -> dict[str, list[str]]:
        """What a generator may lend (``reading_lent``), by key: each layer's q, k and v
        projections as one ``[out, in]`` matrix (key ``{layer}.self_attn.qkv``) and its gate and
        up projections (``{layer}.mlp.gate_up``) where they are kept apart, every other matmul
        weight alone under its own name."""
        groups: dict[str, list[str]] = {}
        fused = set()
        traits = self.spec.traits
        if traits.block == "llama" and not traits.fused_projections:
            for i in self.layers:
                p = layer_prefix(self.spec, i)
                moe = traits.moe
                shared = f"{p}.mlp.{moe.shared_module}" if moe is not None else ""
                mlp = shared if i in self.spec.moe_layers else f"{p}.mlp"
                for prefix, group, names in ((f"{p}.self_attn", "qkv", QKV),
                                             (mlp, "gate_up", GATE_UP)):  # fmt: skip
                    weights = [f"{prefix}.{n}.weight" for n in names]
                    if weights[0] in self.shards:  # (an MoE layer without shared experts: none)
                        groups[f"{prefix}.{group}"] = weights
                        fused.update(weights)
        for name in self.matmul_weights():
            if name not in fused:
                groups[name] = [name]
        return groups

    def weight_out_in(self, name: str) -> torch.Tensor:
        """Matmul weight ``name`` as ``[out, in]`` (GPT-2's Conv1D keeps ``[in, out]``)."""
        w = self.param(name)
        return w.T if self.kept_in_out(name) else w

    def kept_in_out(self, name: str) -> bool:
        """Whether matmul weight ``name`` is kept ``[in, out]`` (GPT-2's Conv1D)."""
        return self.conv1d_prefix is not None and name.startswith(self.conv1d_prefix)

    @contextlib.contextmanager
    def reading_lent(
        self, weights: dict[str, torch.Tensor] | None, merged: bool = False
    ) -> Iterator[None]:
        """Matmuls inside read ``weights`` (a generator's, by ``lendable`` key; a fused group's
        bias under ``{key}.bias``): copies cast to the autocast dtype (what autocast would cast
        them to anyway), or oneDNN-packed copies on CPUs; the weights as they are where none is
        lent (None: everywhere). ``merged``: every adapted weight is lent with its LoRA
        adapter merged in, so no adapter term is added."""
        self.lent, self.lent_merged = weights, merged and weights is not None
        try:
            yield
        finally:
            self.lent, self.lent_merged = None, False

    def matmul(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None):
        """``x`` times matmul weight ``name`` (transposed: a linear layer), plus ``bias``; a lent
        weight is ``[out, in]`` (or packed), except a single Conv1D one, lent as it is kept."""
        lent = self.lent
        w = lent[name] if lent is not None and name in lent else self.param(name)
        if w.is_mkldnn:
            out = torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        elif self.kept_in_out(name):
            out = x @ w if bias is None else torch.addmm(bias, x, w)
        else:
            out = F.linear(x, w, bias)
        pair = self.adapter(name)
        if pair is not None and pair.split != "row":  # (a row-parallel one's: ``_row_linear``)
            out = out + unreduced_term(self, x, pair)
        return out

    def adapter(self, name: str) -> AdapterPair | None:
        """Weight ``name``'s LoRA pair while the adapters are on (``base_weights``) and not
        merged into lent weights; None without one."""
        if not self.adapters or not self.adapters_on or self.lent_merged:
            return None
        return self.adapters.get(name)

    @contextlib.contextmanager
    def base_weights(self) -> Iterator[None]:
        """Compute with the base weights alone, every LoRA adapter's term left out (a reference
        model computed by the LoRA role it was copied from)."""
        self.adapters_on = False
        try:
            yield
        finally:
            self.adapters_on = True

    def weights_fingerprint(self, frozen: bool = False) -> tuple[int, ...]:
        """Changes whenever the weights may have: a new version, new storage, an update in
        place (a copy of them is stale then). ``frozen``: the weights that do not train alone
        (a LoRA role's base), which a new version leaves as they were."""
        params = [p for p in self.parameters() if not (frozen and p.requires_grad)]
        version = () if frozen else (self.version,)
        return (*version, *(p.data_ptr() for p in params), *(p._version for p in params))

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's shards under their Hugging Face names."""
        return {name: self.param(name) for name in self.shards}

    def release(self) -> None:
        """Free the weights' memory (a copy that reallocation refills before its next call)."""
        for name in self.shards:
            self.param(name).data = torch.empty(0, device=self.device, dtype=self.numerics.storage)

    def allocate(self) -> None:
        """Give released weights storage again (uninitialized: reallocation fills it)."""
        for name, shape in self.shard_shapes.items():
            p = self.param(name)
            if tuple(p.shape) != shape:
                p.data = torch.empty(shape, device=p.device, dtype=p.dtype)

    def new_cache(self, n_rows: int, capacity: int) -> KVCache:
        """Keys and values of this rank's attention layers for ``n_rows`` rows of ``capacity``
        tokens; each row's recurrent and convolution state in its Gated DeltaNet layers."""
        spec, net = self.spec, self.spec.delta_net
        attending = [i for i in self.layers if i not in spec.delta_layers]
        cache = KVCache(
            attending, n_rows, capacity, self.n_kv_heads, spec.head_dim,
            self.numerics.compute, self.device,
        )  # fmt: skip
        if net is not None:
            tp, delta = self.groups.tp, [i for i in self.layers if i in spec.delta_layers]
            state = (net.n_value_heads // tp, net.key_dim, net.value_dim)
            cache.hold_states(delta, state, net.conv_channels // tp, net.conv_kernel - 1)
        return cache

    def _linears(
        self, h: torch.Tensor, prefix: str, names: list[str], sizes: list[int], group: str
    ) -> list[torch.Tensor]:
        """``h`` through the linear layers ``prefix.{names}``, one output per ``sizes`` entry: one
        matmul where a generator lends them fused (``lendable``'s ``prefix.group``), or where
        the checkpoint keeps them in one weight (split after)."""
        fused = self._lent_fused(h, f"{prefix}.{group}")
        if fused is not None:
            return list(fused.split(sizes, dim=-1))
        outs = [self.matmul(h, f"{prefix}.{n}.weight", self.param_or_none(f"{prefix}.{n}.bias"))
                for n in names]  # fmt: skip
        return outs if len(outs) == len(sizes) else list(outs[0].split(sizes, dim=-1))

    def _lent_fused(self, h: torch.Tensor, key: str) -> torch.Tensor | None:
        """``h`` times the fused weights a generator lends under ``key`` (with their joined
        bias); None where none are lent."""
        if self.lent is None or key not in self.lent:
            return None
        prefix = f"{key.rsplit('.', 1)[0]}."
        if any(n.startswith(prefix) and self.adapter(n) for n in self.adapters):
            return None  # each adapted weight on its own, its adapter beside it
        return self.matmul(h, key, self.lent.get(f"{key}.bias"))

    def _rope_freq(self, local: bool, device: torch.device) -> torch.Tensor:
        """The RoPE frequencies on ``device``, made once (a captured step copies nothing in)."""
        key = (local, str(device))
        if key not in self._freqs:
            freq = self.spec.rope_inv_freq_local if local else self.spec.rope_inv_freq
            assert freq is not None
            with torch.inference_mode(False):  # a normal tensor, though made while generating
                self._freqs[key] = torch.tensor(freq, dtype=torch.float32, device=device)
        return self._freqs[key]

    def rotary_tables(self, positions: torch.Tensor) -> Rotations:
        """cos and sin of ``positions`` for every frequency set the layers use (Gemma 3's local
        layers rotate at their own), computed once per forward; none with learned positions."""
        spec = self.spec
        if not spec.traits.rope:
            return {}
        freq = self._rope_freq(False, positions.device)
        tables = {False: rotary(positions, freq, spec.rope_scale)}
        if spec.rope_inv_freq_local is not None:
            freq = self._rope_freq(True, positions.device)
            tables[True] = rotary(positions, freq, spec.rope_scale_local)
        return tables

    def forward(
        self,
        x: torch.Tensor,
        where: TokenLayout,
        cache: KVCache | None = None,
        select: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        routes: Routes | None = None,
    ) -> torch.Tensor:
        """Token ids ``[n]`` (first stage) or hidden ``[n, h]`` -> hidden (in the weights'
        dtype), or fp32 logits/values.

        ``select`` (token indices) keeps only those tokens' outputs on the last stage, so a
        prefill computes the LM head for each row's last token only. ``targets`` (``[n]`` token
        ids, -1 where none) makes the last stage return ``score``'s ``[n, 2]`` instead of
        logits. With fp32 master weights and a lower precision, matmuls run under autocast.
        ``routes``: the MoE layers' expert choices to record, compare or replay.
        """
        low = self.numerics.autocast
        # without gradients no cast is reused; a cache kept across a CUDA graph capture breaks it
        cached = torch.is_grad_enabled()
        cast = (
            torch.autocast(x.device.type, dtype=low, cache_enabled=cached)
            if low
            else contextlib.nullcontext()
        )
        with cast:
            return self._forward(x, where.to(x.device), cache, select, targets, temperature, routes)

    def _forward(
        self,
        x: torch.Tensor,
        where: TokenLayout,
        cache: KVCache | None,
        select: torch.Tensor | None,
        targets: torch.Tensor | None = None,
        temperature: float = 1.0,
        routes: Routes | None = None,
    ) -> torch.Tensor:
        positions = where.local_positions
        if self.groups.is_first_stage:
            x = self.embed(x, positions)
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        rot = self.rotary_tables(positions)
        for i in self.layers:
            if recompute and cache is None:
                x = checkpoint(self.layer, x, i, where, None, rot, routes, use_reentrant=False)
            else:
                x = self.layer(x, i, where, cache, rot, routes)
        if self.groups.is_last_stage and targets is not None:
            return self.score(x, targets, temperature)
        if self.groups.is_last_stage:
            x = self.head(x if select is None else x[select]).float()
        return x

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows outside this rank's range give 0, then sum over tp."""
        lo, hi = self.vocab_range
        table = self.param(embedding_name(self.spec))
        spec = self.spec
        positions_table = position_table_name(spec)
        if self.groups.tp_group is None and spec.embed_scale == 1.0 and positions_table is None:
            return F.embedding(ids, table, padding_idx=spec.padding_idx)
        inside = (ids >= lo) & (ids < hi)
        pad = self.spec.padding_idx
        pad = pad - lo if pad is not None and lo <= pad < hi else None
        local = F.embedding((ids - lo).clamp(0, hi - lo - 1), table, padding_idx=pad)
        local = local * inside[:, None]
        x = reduce_from_tp(local, self.groups.tp_group)
        if self.spec.embed_scale != 1.0:  # Gemma: sqrt(hidden), in the table's dtype
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        if positions_table is not None:  # GPT-2's learned positions
            x = x + F.embedding(positions, self.param(positions_table))
        return x

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if self.spec.traits.norm == "layernorm":
            return F.layer_norm(
                x, x.shape[-1:], self.param(f"{name}.weight"), self.param_or_none(f"{name}.bias"),
                self.spec.norm_eps,
            )  # fmt: skip
        return self._scaled(self.param(f"{name}.weight"), x)

    def _scaled(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` times ``weight``: Llama-style (normalize in fp32, cast, times the
        weight) or Gemma's (times 1 + weight in fp32, then cast)."""
        eps, adds_one = self.spec.norm_eps, self.spec.traits.norm_adds_one
        if x.dtype == weight.dtype == torch.float32 and not adds_one:
            # the same rounding in one op (a decode step's 9+ norms are most of its small ops)
            return F.rms_norm(x, x.shape[-1:], weight, eps=eps)
        h = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
        if adds_one:
            return (h * (1.0 + weight.float())).to(x.dtype)
        if self.spec.traits.norm_weight_fp32:  # gpt-oss: times the weight in fp32, then cast
            return (weight * h).to(x.dtype)
        return weight * h.to(x.dtype)

    def _head_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm over each head of this rank's heads. Its weight is shared by every head, on
        every tp rank; each rank's gradient covers its own heads, so backward sums them over tp
        (``copy_to_tp`` of the weight)."""
        weight = copy_to_tp(self.param(f"{name}.weight"), self.groups.tp_group)
        return self._scaled(weight, x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        x = self.final_norm(x)
        if self.spec.value_head:
            return self.matmul(x, "score.weight").squeeze(-1)
        return self.lm_logits(x)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, final_norm_name(self.spec))

    @property
    def head_name(self) -> str:
        """The LM head's weight: its own, or the embedding it is tied to."""
        return embedding_name(self.spec) if self.spec.tied else "lm_head.weight"

    def fp32_head(self) -> torch.Tensor:
        """This rank's LM head weight in fp32 (``numerics.fp32_lm_head``): the fp32 copy a
        generator lends (``rayhf.parallel.lent``), else the weight itself (fp32 master weights)
        or a cast of it (a low copy)."""
        if self.lent is not None and self.head_name in self.lent:
            return self.lent[self.head_name]
        return self.param(self.head_name).float()

    def lm_logits(self, x: torch.Tensor, fp32_table: torch.Tensor | None = None) -> torch.Tensor:
        """The vocab-parallel LM head over normed hidden states: whole-vocabulary logits (gathered
        over tp), soft-capped where the family caps them. With ``numerics.head_in_fp32`` the
        matmul runs outside autocast on fp32 hidden states and weights (``fp32_table``, else
        ``fp32_head()``)."""
        x = copy_to_tp(x, self.groups.tp_group)
        if self.numerics.head_in_fp32:
            table = self.fp32_head() if fp32_table is None else fp32_table
            pair = self.adapter(self.head_name)
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), table)
                if pair is not None:  # (a head's adapters: in fp32 as well)
                    logits = logits + unreduced_term(self, x.float(), pair, torch.float32)
        else:
            logits = self.matmul(x, self.head_name)
        logits = gather_from_tp(logits, self.groups.tp_group, self.spec.vocab_size)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def score(self, x: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        """``[n, 2]`` fp32: each token's log-probability of its target under
        ``softmax(logits / temperature)`` and that distribution's entropy; 0 where the target is
        -1. The LM head runs over ``LOGIT_CHUNK``-sized slices of the scored tokens, and in
        training (of more than one slice) each slice's logits are recomputed in backward
        instead of kept, so no ``[tokens, vocab]`` tensor exists beyond one slice's."""
        out = torch.zeros(len(x), 2, dtype=torch.float32, device=x.device)
        rows = (targets >= 0).nonzero().squeeze(1)
        if not len(rows):
            return out + 0 * x.sum()  # a graph to the input all the same (pp backward)
        h = self.final_norm(x[rows])
        y = targets[rows]
        step = max(1, LOGIT_CHUNK // self.spec.vocab_size)
        # one slice holds every scored token: nothing to save by recomputing it in backward
        recompute = torch.is_grad_enabled() and h.requires_grad and len(rows) > step
        table = self.fp32_head() if self.numerics.head_in_fp32 else None  # cast once, not a slice
        parts = []
        for lo in range(0, len(rows), step):
            args = (h[lo : lo + step], y[lo : lo + step], temperature, table)
            if recompute:
                parts.append(checkpoint(self._scores, *args, use_reentrant=False))
            else:
                parts.append(self._scores(*args))
        return out.index_put((rows,), torch.cat(parts))

    def _scores(
        self, h: torch.Tensor, y: torch.Tensor, temperature: float, table: torch.Tensor | None
    ) -> torch.Tensor:
        """One slice of ``score``: normed hidden states ``[c, h]`` and targets ``[c]`` (``table``:
        the fp32 LM head, see ``lm_logits``)."""
        z = self.lm_logits(h, table).float() / temperature
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        return torch.stack([logp, entropy], dim=-1)

    def layer(
        self,
        x: torch.Tensor,
        i: int,
        where: TokenLayout,
        cache: KVCache | None,
        rot: Rotations,
        routes: Routes | None = None,
    ) -> torch.Tensor:
        p = layer_prefix(self.spec, i)
        if self.spec.traits.block == "conv1d":
            x = x + self._conv1d_attention(self.norm(x, f"{p}.ln_1"), p, where, cache, i)
            return x + self._conv1d_mlp(self.norm(x, f"{p}.ln_2"), p)
        h = self.norm(x, f"{p}.input_layernorm")
        if i in self.spec.delta_layers:
            attn = self._delta_net(h, i, where, cache)
        else:
            attn = self._llama_attention(h, i, where, cache, rot)
        if self.spec.traits.sandwich_norms:  # a norm on each block's output, and one before the MLP
            x = x + self.norm(attn, f"{p}.post_attention_layernorm")
            mlp = self._mlp(self.norm(x, f"{p}.pre_feedforward_layernorm"), i, routes)
            return x + self.norm(mlp, f"{p}.post_feedforward_layernorm")
        x = x + attn
        return x + self._mlp(self.norm(x, f"{p}.post_attention_layernorm"), i, routes)

    def _row_linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """A row-parallel linear layer: this rank's input columns times its weight rows, summed
        over tp, then the bias (whole on every rank)."""
        out = reduce_from_tp(self.matmul(x, f"{name}.weight"), self.groups.tp_group)
        pair = self.adapter(f"{name}.weight")
        if pair is not None and pair.split == "row":
            out = out + reduced_term(self, x, pair)
        bias = self.param_or_none(f"{name}.bias")
        return out if bias is None else out + bias

    def _llama_attention(
        self, h, i: int, where: TokenLayout, cache: KVCache | None, rot: Rotations
    ) -> torch.Tensor:
        spec = self.spec
        p, d = f"{layer_prefix(spec, i)}.self_attn", spec.head_dim
        h = copy_to_tp(h, self.groups.tp_group)
        # this rank's heads of q, k and v (Phi-3 keeps them in one weight)
        names = ["qkv_proj"] if spec.traits.fused_projections else list(QKV)
        gated = spec.traits.attn_output_gate  # each head's query, then its gate
        sizes = [self.n_heads * d * (2 if gated else 1), self.n_kv_heads * d, self.n_kv_heads * d]
        local = spec.window_layers is None or i in spec.window_layers  # a sliding-window layer
        window = spec.sliding_window if local else None
        cos, sin = rot[local and spec.rope_inv_freq_local is not None]  # Gemma 3's local layers
        fused = None if spec.qk_norm else self._lent_fused(h, f"{p}.qkv")
        if fused is not None:  # q and k side by side: one rotation of both
            qk, v = fused.split([sizes[0] + sizes[1], sizes[2]], dim=-1)
            qk = apply_rotary(qk.reshape(-1, self.n_heads + self.n_kv_heads, d), cos, sin)
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=1)
        else:
            q, k, v = self._linears(h, p, names, sizes, "qkv")
            if gated:
                q, gate = q.reshape(-1, self.n_heads, 2 * d).chunk(2, dim=-1)
            q, k = q.reshape(-1, self.n_heads, d), k.reshape(-1, self.n_kv_heads, d)
            if spec.qk_norm:  # Qwen3: RMSNorm over each head's dims, before RoPE
                q, k = self._head_norm(q, f"{p}.q_norm"), self._head_norm(k, f"{p}.k_norm")
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.reshape(-1, self.n_kv_heads, d)
        sinks = self.param_or_none(f"{p}.sinks")  # this rank's heads' (gpt-oss)
        out = self._attend(q, k, v, where, window, cache, i, sinks).flatten(1)
        if gated:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        return self._row_linear(out, f"{p}.o_proj")

    def _attend(
        self,
        q,
        k,
        v,
        where: TokenLayout,
        window: int | None,
        cache: KVCache | None,
        i: int,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """``attention`` of this rank's tokens ``[n, heads, d]``; with context parallelism, of
        every token of the cp group for ``1/cp`` of the heads, and back
        (``rayhf.parallel.context``)."""
        cp, group = self.groups.cp, self.groups.cp_group
        if where.local is None or group is None:
            return attention(
                q, k, v, where, window, cache, i, self.spec.attn_scale, self.spec.attn_softcap,
                sinks,
            )  # fmt: skip
        q, k, v = attention_heads(q, k, v, cp, group)
        if sinks is not None:
            sinks = sinks.chunk(cp)[self.groups.cp_rank]
        out = attention(
            q, k, v, where, window, None, i, self.spec.attn_scale, self.spec.attn_softcap, sinks
        )
        return to_tokens(out, cp, group)

    def _delta_net(
        self, h: torch.Tensor, i: int, where: TokenLayout, cache: KVCache | None
    ) -> torch.Tensor:
        """Layer ``i``'s Gated DeltaNet block over this rank's heads
        (``rayhf.parallel.delta_net``): rows from a zero state (a prefill leaves each row's
        in its cache row), or a decode step's token from its row's state in ``cache``."""
        net, tp = self.spec.delta_net, self.groups.tp
        assert net is not None
        a = f"{layer_prefix(self.spec, i)}.linear_attn"
        h = copy_to_tp(h, self.groups.tp_group)
        heads = (net.n_key_heads // tp, net.n_value_heads // tp, net.key_dim, net.value_dim)
        qkv, z, b, a_in = self._delta_projections(h, a, heads)
        conv = self.param(f"{a}.conv1d.weight")
        beta = b.sigmoid()
        g = decays(a_in, self.param(f"{a}.A_log"), self.param(f"{a}.dt_bias"))
        if where.decode:
            assert cache is not None
            n = len(qkv)
            mixed = conv_step(qkv, cache.conv[i][:n], conv)
            out = rule_step(*split_heads(mixed, *heads), g, beta, cache.state[i][:n])
        else:
            assert where.from_start, "a DeltaNet layer runs each row from its first token"
            rows = by_rows(qkv, where)
            mixed = causal_conv(rows, conv)
            lengths = torch.bincount(where.rows, minlength=where.n_rows)
            kernel = fla_kernel() if h.is_cuda else None
            if kernel is None:
                q, k, v = split_heads(mixed, *heads)
                out, state = gated_delta_rule(q, k, v, by_rows(g, where), by_rows(beta, where))
                out = by_tokens(out, where)
            else:  # flash-linear-attention's kernel, over the packed tokens
                q, k, v = split_heads(by_tokens(mixed, where), *heads)
                out, state = packed_rule(kernel, q, k, v, g, beta, lengths)
            if cache is not None:
                held = slice(where.n_rows) if where.cache_rows is None else where.cache_rows
                cache.state[i][held] = state
                cache.conv[i][held] = history(rows, lengths, net.conv_kernel).to(cache.dtype)
        z = z.reshape(out.shape)
        weight = copy_to_tp(self.param(f"{a}.norm.weight"), self.groups.tp_group)
        out = gated_norm(out, z, weight, self.spec.norm_eps)
        return self._row_linear(out.flatten(1), f"{a}.out_proj")

    def _delta_projections(
        self, h: torch.Tensor, a: str, heads: tuple[int, int, int, int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q|k|v, z, b and a of this rank's DeltaNet heads (``heads``: key heads, value heads,
        key dim, value dim), from their own weights or, fused by key head (Qwen3-Next), split
        out of ``in_proj_qkvz`` and ``in_proj_ba``."""
        assert self.spec.traits.delta_net is not None
        if not self.spec.traits.delta_net.fused:
            names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            qkv, z, b, a_in = (self.matmul(h, f"{a}.{n}.weight") for n in names)
            return qkv, z, b, a_in
        n_keys, n_values, key_dim, value_dim = heads
        served = n_values // n_keys  # value heads a key head serves
        qkvz = self.matmul(h, f"{a}.in_proj_qkvz.weight").unflatten(-1, (n_keys, -1))
        sizes = [key_dim, key_dim, served * value_dim, served * value_dim]
        q, k, v, z = (t.flatten(-2) for t in qkvz.split(sizes, dim=-1))
        ba = self.matmul(h, f"{a}.in_proj_ba.weight").unflatten(-1, (n_keys, -1))
        b, a_in = (t.flatten(-2) for t in ba.split([served, served], dim=-1))
        return torch.cat([q, k, v], dim=-1), z, b, a_in

    def _mlp(self, h: torch.Tensor, i: int, routes: Routes | None = None) -> torch.Tensor:
        """Layer ``i``'s feed-forward block: a gated MLP or a Mixture-of-Experts one."""
        m = f"{layer_prefix(self.spec, i)}.mlp"
        if i in self.moe_index:
            return self._moe_mlp(h, m, self.moe_index[i], routes)
        return self._gated_mlp(h, m)

    def _gated_mlp(self, h: torch.Tensor, m: str) -> torch.Tensor:
        """The gated MLP under module ``m`` (a layer's ``mlp``, or an MoE layer's shared one)."""
        h = copy_to_tp(h, self.groups.tp_group)
        # this rank's columns of gate and of up (Phi-3 keeps them in one weight)
        names = ["gate_up_proj"] if self.spec.traits.fused_projections else list(GATE_UP)
        width = self.param(f"{m}.down_proj.weight").shape[1]  # this rank's intermediate units
        gate, up = self._linears(h, m, names, [width, width], "gate_up")
        return self._row_linear(self.act(gate) * up, f"{m}.down_proj")

    def _moe_mlp(
        self, h: torch.Tensor, m: str, j: int, routes: Routes | None = None
    ) -> torch.Tensor:
        """The Mixture-of-Experts block under module ``m``, the model's ``j``-th
        (``rayhf.parallel.moe``). The router runs whole on every tp rank, on ``h`` as it comes;
        each rank's experts give a part of every token's output, summed over tp, so the routing
        weights' gradient is summed over tp too (``copy_to_tp``), and ``h``'s gradient through
        the experts (not the router's). With ep > 1 the tokens go to the ep rank holding their
        expert and back. ``routes``: see ``Routes``."""
        spec, tp_group, traits = self.spec, self.groups.tp_group, self.spec.traits.moe
        assert spec.moe is not None and traits is not None
        r = f"{m}.{traits.router_module}"
        if traits.router == "sigmoid_grouped":  # from fp32 inputs, as Hugging Face's
            logits = F.linear(h.float(), self.param(f"{r}.weight").float())
        else:
            logits = self.matmul(h, f"{r}.weight", self.param_or_none(f"{r}.bias"))
        bias = self.param_or_none(f"{r}.e_score_correction_bias")
        given = None if routes is None or routes.given is None else routes.given[:, j]
        replay = given if routes is not None and routes.replay else None
        weights, ids, own = route(logits, spec.moe, traits, bias, replay)
        training = self.training and torch.is_grad_enabled() and len(ids) > 0  # a train step's
        if routes is not None and routes.record is not None:
            routes.record[:, j] = ids
        if given is not None and training:
            checks = torch.stack([route_differs(own, given), route_differs(ids, given)])
            self.route_checks.append(checks)
        counts = expert_counts(ids.flatten(), spec.moe.n_experts)
        if training:
            self.expert_loads.append(counts)
        if training and self.balances_bias and bias is not None:
            self.layer_loads[m] = self.layer_loads.get(m, 0) + counts
        if training and self.balancing:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).sum(dim=0)
            squares = torch.logsumexp(logits.float(), dim=-1).square().sum()
            self.router_sums.append((counts, probs, squares, len(ids)))
        gate_up = self.param(f"{m}.experts.gate_up_proj")
        down = self.param(f"{m}.experts.down_proj")
        act, gate_up_bias = glu(self.act), None
        if traits.form == "clamped_swiglu":  # [E, in, out], biased (gpt-oss)
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            act = clamped_swiglu(spec.moe.limit, spec.moe.alpha)
            gate_up_bias = self.param(f"{m}.experts.gate_up_proj_bias")
        out = experts(
            copy_to_tp(h, tp_group),
            copy_to_tp(weights, tp_group),
            ids,
            gate_up,
            down,
            act,
            self.groups.ep_group,
            counts,
            gate_up_bias,
        )
        out = reduce_from_tp(out, tp_group)
        down_bias = self.param_or_none(f"{m}.experts.down_proj_bias")
        if down_bias is not None:  # whole on every rank: after the sum over tp, weighted
            out = out + (weights.unsqueeze(-1) * down_bias[ids]).sum(dim=1).to(out.dtype)
        if spec.moe.shared_size:
            shared = self._gated_mlp(h, f"{m}.{traits.shared_module}")
            if traits.shared_gate:  # whole on every rank, as the shared output is after tp's sum
                name = f"{m}.shared_expert_gate.weight"
                gate = self.matmul(h, name)  # whole, as its adapter
                shared = torch.sigmoid(gate) * shared
            out = out + shared
        return out

    def take_expert_loads(self) -> float | None:
        """The MoE layers' load since the last call: the busiest expert's tokens over the mean
        expert's, averaged over the layers' passes (1.0: even); None without one. One host
        read."""
        loads, self.expert_loads = self.expert_loads, []
        if not loads:
            return None
        counts = torch.stack(loads).float()
        return float((counts.max(dim=1).values / counts.mean(dim=1)).mean())

    def take_balance_losses(self, aux: float, z: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The load-balancing losses of the forwards since the last call, times ``aux`` and
        ``z``, summed (with their graphs), and their values. The auxiliary loss is Hugging
        Face's ``load_balancing_loss_func``: ``E * sum_e f_e * P_e``, f the share of the
        top-k picks and P the mean router probability of expert e, each over every token of
        every MoE layer; the z-loss is each layer's mean squared router logsumexp, summed."""
        sums, self.router_sums = self.router_sums, []
        if not sums:
            return torch.zeros((), device=self.device), {}
        n = sum(s[3] for s in sums)
        picks = torch.stack([s[0] for s in sums]).sum(dim=0).float() / n
        probs = torch.stack([s[1] for s in sums]).sum(dim=0) / n
        assert self.spec.moe is not None
        balance = self.spec.moe.n_experts * (picks * probs).sum()
        z_loss = sum((s[2] / s[3] for s in sums), torch.zeros((), device=self.device))
        values = {
            "router_aux_loss": float(balance.detach()),
            "router_z_loss": float(z_loss.detach()),
        }
        return aux * balance + z * z_loss, values

    def update_correction_biases(self, rate: float, dp_group: dist.ProcessGroup | None) -> None:
        """Move each sigmoid-routed MoE layer's score-correction bias by ``rate`` toward an even
        load: up for each expert that took fewer tokens than the mean since the last call, down
        for one that took more, the tokens summed over ``dp_group`` (every replica moves its
        copy alike). Every rank of the group calls it (a rank with no tokens adds none)."""
        loads, self.layer_loads = self.layer_loads, {}
        assert self.spec.moe is not None
        names = [f"{layer_prefix(self.spec, i)}.mlp" for i in self.layers if i in self.moe_index]
        names = [m for m in names if f"{m}.gate.e_score_correction_bias" in self.shards]
        # (only a sigmoid router, named ``gate``, has one)
        if not names:
            return
        zeros = torch.zeros(self.spec.moe.n_experts, dtype=torch.int64, device=self.device)
        counts = torch.stack([loads.get(m, zeros) for m in names]).float()
        if dp_group is not None:
            dist.all_reduce(counts, group=dp_group)
        with torch.no_grad():
            for m, c in zip(names, counts, strict=True):
                bias = self.param(f"{m}.gate.e_score_correction_bias")
                bias.add_(rate * torch.sign(c.mean() - c).to(bias.dtype))

    def take_route_checks(self) -> dict[str, float]:
        """Since the last call, of the tokens a generator routed (``Routes.given``), per MoE
        layer: the share whose router chose another expert set than the generator's
        (``routes_differ_own``), and the share that went to another set
        (``routes_differ``: 0 when replayed); empty without any. One host read."""
        checks, self.route_checks = self.route_checks, []
        if not checks:
            return {}
        own, used = torch.stack(checks).sum(dim=0).tolist()
        total = max(own[1], 1)
        return {"routes_differ_own": own[0] / total, "routes_differ": used[0] / total}

    def _conv1d_attention(
        self, h: torch.Tensor, layer: str, where: TokenLayout, cache: KVCache | None, i: int
    ) -> torch.Tensor:
        p, d = f"{layer}.attn", self.spec.head_dim
        h = copy_to_tp(h, self.groups.tp_group)
        qkv = self.matmul(h, f"{p}.c_attn.weight", self.param(f"{p}.c_attn.bias"))
        q, k, v = (t.reshape(-1, self.n_heads, d) for t in qkv.chunk(3, dim=-1))
        out = self._attend(q, k, v, where, None, cache, i, None).flatten(1)
        return self._row_linear(out, f"{p}.c_proj")

    def _conv1d_mlp(self, h: torch.Tensor, p: str) -> torch.Tensor:
        h = copy_to_tp(h, self.groups.tp_group)
        inner = self.act(self.matmul(h, f"{p}.mlp.c_fc.weight", self.param(f"{p}.mlp.c_fc.bias")))
        return self._row_linear(inner, f"{p}.mlp.c_proj")
