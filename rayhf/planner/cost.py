"""Analytic cost model: a call's time and peak memory per device under a layout, from FLOPs and
bytes (model shape x workload) and the device's rates. Pure arithmetic, no Ray.

It models rayhf's own execution (eager PyTorch, ``rayhf/parallel``), not an idealized one:
- compute: 2 FLOPs per parameter per token forward (+ causal attention), x3 for forward and
  backward; pipeline stages run GPipe, so a pass of m micro-batches takes ``m + pp - 1`` stage
  times; tp adds two all-reduces per layer forward (four with backward);
- per layer and micro-batch a pass costs the longest of its matmul FLOPs, its bytes read
  (weights included, so tiny micro-batches are weight-read bound) and the host's launches of
  the layer's eager ops (``Efficiency.ops_per_layer``: rayhf has no CUDA graphs or fusion;
  launches overlap the GPU's work, so they only cost where the GPU would wait for them);
- pp: every micro-batch crosses each stage boundary point to point (a latency plus its hidden
  states); after a forward the last stage broadcasts its output (values, or each token's
  log-prob and entropy) to its pipeline (``Pipeline.broadcast``); tp gathers the logits of the
  vocab-parallel head, a slice at a time;
- training: per minibatch one forward+backward, one gradient all-reduce over dp and one AdamW
  step over the optimizer's shard (ZeRO 1-2: the state split over dp, a reduce-scatter and an
  all-gather moving what the all-reduce moves); ZeRO-3 gathers every weight before the forward
  and again before the backward and reduce-scatters the gradients, prefetched under the compute
  (DeepSpeed and FSDP overlap them), so a minibatch takes the longer of the two; an offloaded
  optimizer (DeepSpeed's ``offload``) sends its gradients down the host link, steps in host
  memory at the device's share of it and sends the weights back, none of it overlapped;
- generation (``rayhf.parallel.decode``): prefill is one unmicro-batched pass (stages in
  turn); each decode step walks the stages one after another, reading every weight shard and
  the keys and values of the filled slots (rounded up to whole ``KEY_BLOCK``s, as the captured
  step attends; grouped query heads share their key head), its tp all-reduces inside it; the
  step is one CUDA graph per stage, so the host pays a graph launch per stage, not one per op,
  and one sync every ``CHECK_EVERY`` steps;
- memory: weights, gradients and AdamW state (fp32 master + two moments; the ZeRO stage splits
  them over dp), activations of every micro-batch in flight (GPipe), the KV cache (every row's
  prompt and response, in whole blocks), and one slice of the scoring head's fp32 logits
  (``scoring_bytes``: never the whole batch's).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Literal

from rayhf.engines.config import EngineConfig, default_engine
from rayhf.models.sharding import param_shards, shard_numel
from rayhf.models.spec import ModelSpec
from rayhf.parallel.buckets import (
    CHECK_EVERY,
    DELTA_CHUNK,
    LOGIT_CHUNK,
    cache_capacity,
    mean_keys,
)
from rayhf.parallel.layout import Layout
from rayhf.planner.hardware import ClusterSpec

ACTIVATION_BYTES_PER_HIDDEN = 34  # per token per layer per hidden unit, bf16 (Megatron, no
# recomputation: Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 2)


@dataclass(frozen=True)
class Workload:
    """What one call computes in one step."""

    kind: Literal["generate", "inference", "train"]
    n_seqs: int  # sequences in the step's batch
    prompt_len: int
    gen_len: int  # new tokens (generate); inference and train see prompt + gen tokens
    n_minibatches: int = 1  # optimizer steps per train call (per epoch)
    # the call's engine (its traits: whole-model ranks, a resident server, ...); left out, the
    # kind's default (filled in on creation, never None after)
    engine: EngineConfig = None  # type: ignore[assignment]
    zero_stage: int = 0  # train: what the optimizer shards over dp (ZeRO-1 torch, DeepSpeed)
    offload: bool = False  # train: optimizer state in host memory (DeepSpeed)
    # train: the ZeRO stages a plan may give the call instead of ``zero_stage`` (0-1 on any
    # layout with the torch engine, 2-3 run on DeepSpeed: one whole model per rank)
    zero_choices: tuple[int, ...] = ()
    checkpointing: bool = False  # train: each layer's input kept, the layer re-run in backward
    token_budget: int = 0  # train/inference: tokens per micro-batch (0: a minibatch whole)
    epochs: int = 1  # train: passes over the minibatches
    forward_share: float = 0.0  # train: share of the batch forwarded without gradients first

    def __post_init__(self) -> None:
        if self.engine is None:
            object.__setattr__(self, "engine", default_engine(self.kind))

    def micro_batches(self, n_seqs: int, seq: int) -> int:
        """How many micro-batches a token budget cuts ``n_seqs`` sequences into (1: none)."""
        if not self.token_budget:
            return 1
        return max(1, min(n_seqs, math.ceil(n_seqs * seq / self.token_budget)))

    def choices_on(self, layout: Layout) -> tuple[int, ...]:
        """The ``zero_choices`` ``layout`` allows, in order (2-3 run on DeepSpeed: dp only, no
        sequence split; with experts split over ep ranks, none: each rank's experts are its
        own)."""
        if layout.ep > 1:
            return (0,)
        dp_only = layout.tp == 1 and layout.pp == 1 and layout.cp == 1
        return tuple(sorted(s for s in self.zero_choices if s < 2 or dp_only))

    def with_stage(self, stage: int) -> Workload:
        """This train call at ZeRO ``stage`` (2 and 3 on DeepSpeed)."""
        engine = self.engine.at_zero_stage(stage)
        return dataclasses.replace(self, zero_stage=stage, engine=engine)

    @property
    def whole_model_ranks(self) -> bool:
        """Whether the engine runs one whole model per rank (tp = pp = 1 layouts only)."""
        return self.engine.whole_model_ranks


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak the kernels reach and the host's per-op cost (fit by profiling on a
    machine at hand; the defaults are for GPUs driven by eager PyTorch)."""

    compute: float = 0.45
    memory: float = 0.7
    # Host time to issue one eager PyTorch op (Python, autograd and ATen dispatch,
    # cudaLaunchKernel): ~5-25 us per op on current CPUs; the low end is used.
    op_seconds: float = 5e-6
    # Ops one decoder layer of rayhf's model issues per pass (norms, rope, attention's scatter
    # and mask, matmuls, residuals): 70 forward, 70 backward, counted with a TorchDispatchMode
    # over rayhf/parallel/model.py (Llama, tp=1).
    ops_per_layer: int = 70
    # Host time of one captured decode step on one stage: cudaGraphLaunch and the Python
    # around it (~10-20 us on current CPUs).
    replay_seconds: float = 2e-5
    # Host time of one look at which rows ended (a device-to-host copy and its sync).
    sync_seconds: float = 5e-5


@dataclass(frozen=True)
class Rows:
    """What one replica runs through a pass: ``n_seqs`` sequences of ``seq`` tokens each."""

    n_seqs: float
    seq: int


@dataclass(frozen=True)
class PassKind:
    """What a pass does besides its forward."""

    backward: bool = False  # a train step's backward after the forward
    recompute: bool = False  # activation checkpointing: each layer's forward again in backward
    full_output: bool = True  # every token's logits or values (a tp gather, a pp broadcast)


@dataclass(frozen=True)
class CallCost:
    seconds: float
    memory: float  # peak bytes on the busiest device of the mesh during the call
    parts: dict[str, float] = field(default_factory=dict)  # seconds by component
    # of ``seconds``, those its processes spend blocked on the links (a collective's latency,
    # ZeRO-3's fetch of each weight tensor): on emulated devices they hold no core
    waits: float = 0.0


@functools.lru_cache(maxsize=4096)
def max_shard_params(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters on the fullest device of a ``tp x pp`` layout (experts split ``ep`` ways)."""
    return max(shard_numel(spec, tp, pp, 0, s, ep) for s in range(pp))


def _layout_shard(spec: ModelSpec, layout: Layout) -> int:
    return max_shard_params(spec, layout.tp, layout.pp, layout.ep)


@functools.lru_cache(maxsize=4096)
def max_trained_params(spec: ModelSpec, tp: int, pp: int, ep: int = 1) -> int:
    """Of ``max_shard_params``, those the optimizer steps: all of them, but for a LoRA role
    (``spec.lora``) only its adapters and the modules it trains in full."""
    if spec.lora is None:
        return max_shard_params(spec, tp, pp, ep)
    return max(shard_numel(spec, tp, pp, 0, s, ep, trained=True) for s in range(pp))


def _trained_shard(spec: ModelSpec, layout: Layout) -> int:
    return max_trained_params(spec, layout.tp, layout.pp, layout.ep)


@functools.lru_cache(maxsize=256)
def frozen_matmul(spec: ModelSpec) -> int:
    """A LoRA role's frozen matmul parameters (no embedding), whose backward computes the
    gradient of its input only; 0 for a model that trains in full."""
    if spec.lora is None:
        return 0
    return sum(p.numel for p in param_shards(spec) if not p.trained and p.unit != 0)


@functools.lru_cache(maxsize=1024)
def expert_params(spec: ModelSpec) -> int:
    """The routed experts' parameters, every layer's."""
    return sum(p.numel for p in param_shards(spec) if p.expert)


@functools.lru_cache(maxsize=256)
def _sizes(spec: ModelSpec) -> tuple[int, int, int]:
    """(all parameters, parameters a token's forward multiplies, embedding parameters): of the
    routed experts a token multiplies ``top_k`` of every layer's ``n_experts``."""
    total = embed = 0
    for p in param_shards(spec):
        total += p.numel
        if p.unit == 0:
            embed += p.numel
    experts = expert_params(spec)
    idle = round(experts - experts_read(spec, experts, 1))
    return total, total - embed - idle, embed


def experts_read(spec: ModelSpec, experts: float, tokens: float) -> float:
    """Of ``experts`` routed-expert parameters, those a pass over ``tokens`` tokens reads: the
    experts at least one token chooses, expected under uniform routing."""
    if spec.moe is None:
        return experts
    skip = 1 - spec.moe.top_k / spec.moe.n_experts  # a token passes an expert by
    return experts * (1 - skip ** max(tokens, 1.0))


@functools.lru_cache(maxsize=4096)
def weights_read(spec: ModelSpec, tokens: float, ep: int = 1) -> float:
    """Matmul parameters (no embedding) a device's pass over ``tokens`` tokens reads: all of
    them but the routed experts no token chooses; with the experts split ``ep`` ways, its share
    of them, chosen by the tokens of its ep group."""
    total, _, embed = _sizes(spec)
    experts = expert_params(spec)
    return total - embed - experts + experts_read(spec, experts / ep, tokens * ep)


VLLM_KV_BYTES = 2**30  # the KV cache a vLLM engine reserves (VLLM_CPU_KVCACHE_SPACE=1 here)


def _allreduce(n_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * n_bytes / bandwidth + latency


def attention_layers(spec: ModelSpec) -> int:
    """Layers that attend over every earlier token (a hybrid's others are DeltaNet layers)."""
    return spec.n_layers - len(spec.delta_layers)


def mixing_flops(spec: ModelSpec, seq: float) -> float:
    """FLOPs per token of an average layer's token mixing at ``seq`` tokens, forward: causal
    attention's scores and weighted values (``2 * hidden * seq``); a DeltaNet layer's chunked
    rule instead, linear in length: within a chunk, scores and corrections over its
    ``DELTA_CHUNK`` tokens, and across chunks the state read and updated, per value head."""
    attention = attention_layers(spec) * 2 * spec.hidden_size * seq
    net = spec.delta_net
    if net is None:
        return attention / spec.n_layers
    dk, dv, chunk = net.key_dim, net.value_dim, min(DELTA_CHUNK, seq)
    per_head = 2 * chunk * (2 * dk + dv) + 6 * dk * dv
    return (attention + len(spec.delta_layers) * net.n_value_heads * per_head) / spec.n_layers


def delta_state_bytes(spec: ModelSpec, b: int) -> float:
    """One row's decode state in the DeltaNet layers: the fp32 recurrent state and the
    convolution's last inputs in the compute dtype (``b`` bytes)."""
    net = spec.delta_net
    if net is None:
        return 0.0
    state = net.n_value_heads * net.key_dim * net.value_dim * 4
    return len(spec.delta_layers) * (state + net.conv_channels * (net.conv_kernel - 1) * b)


def scoring_bytes(spec: ModelSpec, tokens: float) -> float:
    """The LM head's transient bytes while scoring ``tokens`` (``ShardedModel.score``): one
    slice of at most ``LOGIT_CHUNK`` fp32 logits, three such tensors at once (the logits, their
    softmax, and in backward a gradient); a value head's are negligible."""
    if spec.value_head:
        return 0.0
    return 3 * 4 * min(tokens * spec.vocab_size, LOGIT_CHUNK)


class AnalyticCost:
    """Costs from FLOPs and bytes on ``cluster``'s devices."""

    def __init__(self, cluster: ClusterSpec, efficiency: Efficiency | None = None) -> None:
        self.cluster = cluster
        self.eff = efficiency or Efficiency()
        self._calls: dict[tuple[ModelSpec, Layout, Workload], CallCost] = {}

    def _flops_rate(self, spec: ModelSpec) -> float:
        """Matmul FLOP/s in the role's compute dtype (fp32 on a bf16 device: its fp32 rate)."""
        device = self.cluster.device
        fp32 = self.dtype_bytes(spec) == 4 and device.dtype_bytes < 4 and device.fp32_flops
        return (device.fp32_flops if fp32 else device.flops) * self.eff.compute

    def _bytes_rate(self) -> float:
        return self.cluster.device.memory_bandwidth * self.eff.memory

    def _tp_bandwidth(self, layout: Layout) -> float:
        return self.cluster.bandwidth(layout.mesh[: layout.tp])

    def _dp_bandwidth(self, layout: Layout, n: int) -> float:
        """The slowest link among ``n`` neighbouring dp ranks (an ep or cp group, or all of
        them; their ranks are ``tp x pp`` devices apart)."""
        stride = layout.tp * layout.pp
        return self.cluster.bandwidth(layout.mesh[: stride * n : stride])

    def _pp_bandwidth(self, layout: Layout) -> float:
        """The slowest link of one pipeline (its stages are ``tp`` devices apart)."""
        return self.cluster.bandwidth(layout.mesh[: layout.tp * layout.pp : layout.tp])

    def _layer_seconds(
        self, spec: ModelSpec, layout: Layout, tokens: float, seq: int, how: PassKind
    ) -> float:
        """One decoder layer over a micro-batch of ``tokens`` on one device (``how.recompute``:
        activation checkpointing runs its forward again in backward)."""
        backward, recompute = how.backward, how.recompute
        _, matmul, _ = _sizes(spec)
        b = self.dtype_bytes(spec)
        passes = 3 if backward else 1  # backward: gradients of inputs and of weights
        passes += 1 if backward and recompute else 0
        frozen = frozen_matmul(spec) / spec.n_layers  # a LoRA role's: no weight gradients
        still = passes - 1 if backward else passes
        flops = tokens * (
            2 * (passes * (matmul / spec.n_layers - frozen) + still * frozen)
            + passes * mixing_flops(spec, seq)
        )
        # weights read forward, read again and their gradients written backward; activations
        # written forward, read back backward
        acts = tokens * spec.hidden_size * ACTIVATION_BYTES_PER_HIDDEN * b / 2
        weights = weights_read(spec, tokens, layout.ep) / spec.n_layers
        reads = passes * (weights - frozen) + still * frozen  # a frozen one: no gradient
        n_bytes = (reads * b + (2 if backward else 1) * acts) / layout.tp
        gpu = max(flops / layout.tp / self._flops_rate(spec), n_bytes / self._bytes_rate())
        issued = (2 if backward else 1) + (1 if backward and recompute else 0)  # op passes
        host = issued * self.eff.ops_per_layer * self.eff.op_seconds
        reduce = _allreduce(
            tokens * spec.hidden_size * b, layout.tp, self._tp_bandwidth(layout),
            self.cluster.link_latency,
        )  # fmt: skip
        exchange = self.exchange_seconds(spec, layout, tokens, backward)
        context = self.context_seconds(spec, layout, tokens, backward)
        return max(gpu, host) + (4 if backward else 2) * reduce + exchange + context

    def exchange_seconds(
        self, spec: ModelSpec, layout: Layout, tokens: float, backward: bool
    ) -> float:
        """An average layer's share of the MoE layers' token exchanges with ``layout.ep`` ranks
        (each a dispatch and a combine forward, both again backward): each of a device's
        ``tokens`` sends its ``top_k`` choices' hidden states, ``(ep - 1) / ep`` of them to
        other ranks, and the row counts first (a host read)."""
        if spec.moe is None or layout.ep == 1:
            return 0.0
        bandwidth = self._dp_bandwidth(layout, layout.ep)
        rows = tokens * spec.moe.top_k * (layout.ep - 1) / layout.ep / layout.tp
        one = rows * spec.hidden_size * self.dtype_bytes(spec) / bandwidth
        per_layer = (4 if backward else 2) * (one + self.cluster.link_latency)
        per_layer += self.cluster.link_latency  # the counts' exchange
        return per_layer * len(spec.moe_layers) / spec.n_layers

    def context_seconds(
        self, spec: ModelSpec, layout: Layout, tokens: float, backward: bool
    ) -> float:
        """An average layer's share of the attention layers' exchanges over ``layout.cp`` ranks
        (``rayhf.parallel.context``): a device's ``tokens`` (its slice) send their queries, keys,
        values and outputs, ``(cp - 1) / cp`` of each to other ranks, one all-to-all each
        forward and again backward; key/value heads ``cp`` does not divide go repeated."""
        cp = layout.cp
        if cp == 1:
            return 0.0
        bandwidth = self._dp_bandwidth(layout, cp)
        heads, kv = spec.n_heads // layout.tp, spec.n_kv_heads // layout.tp
        kv = kv if kv % cp == 0 else heads
        elements = (2 * heads + 2 * kv) * spec.head_dim * tokens * (cp - 1) / cp
        one = elements * self.dtype_bytes(spec) / bandwidth + 4 * self.cluster.link_latency
        return (2 if backward else 1) * one * attention_layers(spec) / spec.n_layers

    def _pass_seconds(
        self, spec: ModelSpec, layout: Layout, rows: Rows, n_microbatches: int, how: PassKind
    ) -> float:
        """A pipelined pass over ``rows`` in ``n_microbatches`` micro-batches, plus the output's
        tp gather, cp gather and pp broadcast (``how.full_output``: every token's logits or
        values); with ``layout.cp`` > 1 a device holds ``1/cp`` of each micro-batch's tokens."""
        n_seqs, seq, backward = rows.n_seqs, rows.seq, how.backward
        mbs = max(1, min(n_microbatches, n_seqs))  # ``split_tokens`` makes no empty micro-batch
        tokens = n_seqs * seq / mbs / layout.cp
        b = self.dtype_bytes(spec)
        stage = math.ceil(spec.n_layers / layout.pp) * self._layer_seconds(
            spec, layout, tokens, seq, how
        )
        if layout.pp > 1:  # receive the micro-batch's hidden states (and send their gradients)
            hop = self.cluster.link_latency + tokens * spec.hidden_size * b / self._pp_bandwidth(
                layout
            )
            stage += (2 if backward else 1) * hop
        seconds = (mbs + layout.pp - 1) * stage
        if not how.full_output:
            return seconds
        tokens_out = n_seqs * seq
        if layout.tp > 1 and not spec.value_head:  # the vocab-parallel head's slices, gathered
            gathered = tokens_out * spec.vocab_size * b
            seconds += (layout.tp - 1) / layout.tp * gathered / self._tp_bandwidth(layout)
            seconds += self.cluster.link_latency
        per_token = 1 if spec.value_head else 2  # values, or log-probs and entropies (fp32)
        if layout.pp > 1:  # the last stage broadcasts them
            seconds += tokens_out * per_token * 4 / self._pp_bandwidth(layout)
            seconds += self.cluster.link_latency
        if layout.cp > 1:  # the last stage gathers them over the cp group, a slice a rank
            group = self._dp_bandwidth(layout, layout.cp)
            seconds += (layout.cp - 1) / layout.cp * tokens_out * per_token * 4 / group
            seconds += self.cluster.link_latency
        return seconds

    def forward_seconds(
        self, spec: ModelSpec, layout: Layout, rows: Rows, backward: bool = False,
        work: Workload | None = None,
    ) -> float:  # fmt: skip
        """One forward (and backward) over a replica's ``rows``, cut into micro-batches by
        ``work``'s token budget, its layers recomputed in backward with ``work.checkpointing``."""
        n_seqs, seq = int(rows.n_seqs), rows.seq
        k = work.micro_batches(n_seqs, seq) if work is not None else 1
        how = PassKind(backward, recompute=work is not None and work.checkpointing)
        per = math.ceil(n_seqs / k)
        return k * self._pass_seconds(spec, layout, Rows(per, seq), layout.n_microbatches, how)

    def decode_seconds(self, spec: ModelSpec, layout: Layout, n_seqs: int, keys: float) -> float:
        """One decode step (one token per row, attending over ``keys`` key slots), stages in
        turn: the longer of its FLOPs and its bytes (every weight shard, the keys and values
        once) and of the host's graph launches (and its share of a sync), plus tp's
        all-reduces and pp's hops."""
        _, matmul, _ = _sizes(spec)
        b = self.dtype_bytes(spec)
        weights = weights_read(spec, n_seqs) * b / layout.tp
        attending = attention_layers(spec)
        kv = 2 * attending * n_seqs * keys * spec.n_kv_heads * spec.head_dim * b / layout.tp
        kv += 2 * n_seqs * delta_state_bytes(spec, b) / layout.tp  # read and written
        flops = n_seqs * (2 * matmul + 4 * attending * spec.hidden_size * keys)
        if spec.delta_net is not None:  # the state read, decayed, corrected and read again
            net = spec.delta_net
            flops += n_seqs * len(spec.delta_layers) * net.n_value_heads * 8 * net.key_dim * (
                net.value_dim
            )  # fmt: skip
        gpu = max(flops / layout.tp / self._flops_rate(spec), (weights + kv) / self._bytes_rate())
        host = layout.pp * self.eff.replay_seconds + self.eff.sync_seconds / CHECK_EVERY
        lat = self.cluster.link_latency
        comm = (2 * spec.n_layers + 1) * lat if layout.tp > 1 else 0.0  # + the logits gather
        comm += (layout.pp - 1) * lat + (2 * lat if layout.pp > 1 else 0.0)  # hops, broadcast
        return max(gpu, host) + comm

    def call(self, spec: ModelSpec, layout: Layout, work: Workload) -> CallCost:
        """Time and peak memory of one call of ``work`` on ``layout`` (memoized: the search
        prices the same few thousand (model, layout, workload) triples over and over)."""
        key = (spec, layout, work)
        if key not in self._calls:
            self._calls[key] = self._call(spec, layout, work)
        return self._calls[key]

    def _call(self, spec: ModelSpec, layout: Layout, work: Workload) -> CallCost:
        n_seqs = math.ceil(work.n_seqs / layout.batch_groups)  # a cp group's ranks share theirs
        seq = work.prompt_len + work.gen_len
        parts: dict[str, float] = {}
        if work.kind == "generate":
            parts["prefill"] = self._pass_seconds(
                spec, layout, Rows(n_seqs, work.prompt_len), 1, PassKind(full_output=False)
            )
            keys = mean_keys(work.prompt_len, work.gen_len, True)
            steps = max(0, work.gen_len - 1)  # the prefill chooses each row's first token
            parts["decode"] = steps * self.decode_seconds(spec, layout, n_seqs, keys)
        elif work.kind == "inference":
            parts["forward"] = self.forward_seconds(spec, layout, Rows(n_seqs, seq), work=work)
        else:
            per_minibatch = math.ceil(n_seqs / work.n_minibatches)
            passes = self.forward_seconds(spec, layout, Rows(per_minibatch, seq), True, work)
            if work.zero_stage >= 3:  # two gathers and a reduce-scatter, under the compute
                passes = max(passes, 3 * self._gather_seconds(spec, layout, work))
            steps = work.epochs * work.n_minibatches
            optimizer = self._optimizer_seconds(spec, layout, work.zero_stage, work)
            parts["forward_backward"], parts["optimizer"] = steps * passes, steps * optimizer
            if work.forward_share:  # e.g. decoupled PPO's proximal log-probs
                share = math.ceil(n_seqs * work.forward_share)
                parts["forward"] = self.forward_seconds(spec, layout, Rows(share, seq), work=work)
        return CallCost(sum(parts.values()), self.memory(spec, layout, work), parts)

    def _optimizer_seconds(
        self, spec: ModelSpec, layout: Layout, zero: int = 0, work: Workload | None = None
    ) -> float:
        """Gradient all-reduce over dp (ZeRO-3: reduce-scattered in the backward) plus one AdamW
        pass over this device's part of the optimizer state (all of its shard at stage 0): of
        the weights that train (a LoRA role's adapters)."""
        shard = _trained_shard(spec, layout)
        wb = self.train_bytes(spec, work)
        bandwidth, lat = self._dp_bandwidth(layout, layout.dp), self.cluster.link_latency
        # experts split over ep ranks reduce over the dp / ep ranks that hold the same ones
        experts = expert_params(spec) / (layout.ep * layout.tp * layout.pp) if layout.ep > 1 else 0
        reduce = _allreduce((shard - experts) * wb, layout.dp, bandwidth, lat)
        reduce += _allreduce(experts * wb, layout.dp // layout.ep, bandwidth, lat)
        owned = shard / (layout.dp if zero >= 1 else 1)
        return (0.0 if zero >= 3 else reduce) + self._adamw_seconds(owned, wb, work)

    def _adamw_seconds(self, owned: float, wb: int, work: Workload | None) -> float:
        """AdamW over ``owned`` parameters, reading and writing 16 bytes of state each, in the
        device's memory; offloaded (``work.offload``), in host memory at the device's share of
        it, its gradients sent down and its weights back up the host link first."""
        if work is None or not work.offload:
            return 2 * 16 * owned / self._bytes_rate()
        cluster, device = self.cluster, self.cluster.device
        link = cluster.host_link_bandwidth or device.memory_bandwidth
        memory = cluster.host_memory_bandwidth or device.memory_bandwidth
        return 2 * owned * wb / link + 2 * 16 * owned / (memory * self.eff.memory)

    def _gather_seconds(
        self, spec: ModelSpec, layout: Layout, work: Workload | None = None
    ) -> float:
        """ZeRO-3: one all-gather of the weights over dp (or reduce-scatter of the gradients),
        layer by layer."""
        shard = _layout_shard(spec, layout) * self.train_bytes(spec, work)
        dp = layout.dp
        bandwidth = self._dp_bandwidth(layout, layout.dp)
        return (dp - 1) / dp * shard / bandwidth + spec.n_layers * self.cluster.link_latency

    def resident(
        self, spec: ModelSpec, layout: Layout, trainable: bool, work: Workload | None = None
    ) -> float:
        """Bytes a role keeps on each device of its home layout between calls (``work``: its
        train call's, for how the optimizer shards its state)."""
        zero, offload = (work.zero_stage, work.offload) if work is not None else (0, False)
        # trained weights and gradients at ``wb`` bytes (4: fp32, AdamW's 2 moments beside them;
        # 2: DeepSpeed's bf16, its fp32 master copy in the optimizer too); ZeRO stage ``zero``
        # splits the optimizer state (1), the gradients (2) and the weights (3) over dp, and
        # ``offload`` keeps the optimizer state in host memory; a LoRA role's frozen weights
        # have neither gradients nor optimizer state (stored as its trained ones, one dtype)
        shard, dp = _layout_shard(spec, layout), layout.dp
        if not trainable:
            return float(shard * self.weight_bytes(spec))
        wb = self.train_bytes(spec, work)
        trained = _trained_shard(spec, layout)
        optimizer = (8 if wb == 4 else 12) * trained
        weights = shard * wb / (dp if zero >= 3 else 1)
        grads = trained * wb / (dp if zero >= 2 else 1)
        return weights + grads + (0.0 if offload else optimizer / (dp if zero >= 1 else 1))

    def train_bytes(self, spec: ModelSpec, work: Workload | None) -> int:
        """Bytes per trained weight and gradient: fp32 on rayhf's torch engine at every
        precision (autocast over fp32 weights), the compute dtype on DeepSpeed at bf16 (its
        bf16 mode: bf16 weights, gathers and gradients, an fp32 master copy in the optimizer,
        as OpenRLHF and verl's FSDP gather bf16)."""
        b = self.dtype_bytes(spec)
        low = work is not None and work.engine.trains_in_compute_dtype
        return b if low and b == 2 else 4

    def dtype_bytes(self, spec: ModelSpec) -> int:
        """Bytes per element of the role's compute dtype (activations, caches, frozen copies)."""
        return spec.dtype_bytes or self.cluster.device.dtype_bytes

    def weight_bytes(self, spec: ModelSpec) -> int:
        """Bytes per weight of a copy of the role that does not train: its compute dtype, or
        fp32 for a moving-average role (it blends into fp32 weights)."""
        return 4 if spec.master else self.dtype_bytes(spec)

    def engine_resident(self, spec: ModelSpec, work: Workload) -> float:
        """Bytes a call's engine keeps on each device of the call's layout for the whole run:
        vLLM's own whole copy of the weights and its reserved KV cache."""
        if not work.engine.server_resident:
            return 0.0
        return max_shard_params(spec, 1, 1) * self.dtype_bytes(spec) + VLLM_KV_BYTES

    def least_memory(self, spec: ModelSpec, layout: Layout, work: Workload) -> float:
        """``memory`` at the ZeRO stage (of the call's own and its choices) that keeps least."""
        stages = {work.zero_stage, *work.choices_on(layout)}
        return min(self.memory(spec, layout, work.with_stage(s)) for s in stages)

    def memory(self, spec: ModelSpec, layout: Layout, work: Workload) -> float:
        """Peak bytes on a device while the call runs, its weights and its engine's included (a
        trained role's gradients and optimizer state only in its train call)."""
        return self._memory(spec, layout, work) + self.engine_resident(spec, work)

    def _memory(self, spec: ModelSpec, layout: Layout, work: Workload) -> float:
        b = self.dtype_bytes(spec)
        n_seqs = math.ceil(work.n_seqs / layout.batch_groups)  # a cp group's ranks share theirs
        seq = work.prompt_len + work.gen_len
        layers = math.ceil(spec.n_layers / layout.pp)
        if work.kind == "generate":
            slots = cache_capacity(work.prompt_len, work.gen_len, True)
            share = layers / spec.n_layers  # of the attention layers and the DeltaNet ones
            kv = 2 * attention_layers(spec) * share * n_seqs * slots * spec.n_kv_heads
            kv = (kv * spec.head_dim * b + share * n_seqs * delta_state_bytes(spec, b)) / layout.tp
            transient = kv + n_seqs * spec.vocab_size * 4
            return self.resident(spec, layout, False) + transient
        if work.kind == "inference":  # a token budget's micro-batches run one after another
            k = work.micro_batches(n_seqs, seq)
            tokens = n_seqs * seq / k / layout.n_microbatches / layout.cp
            acts = tokens * spec.hidden_size * ACTIVATION_BYTES_PER_HIDDEN * b / 2 / layout.tp
            return self.resident(spec, layout, False) + acts + scoring_bytes(spec, tokens)
        k = work.micro_batches(math.ceil(n_seqs / work.n_minibatches), seq)
        tokens = n_seqs * seq / work.n_minibatches / k / layout.cp
        layer = tokens * spec.hidden_size * ACTIVATION_BYTES_PER_HIDDEN * b / 2 / layout.tp
        if work.checkpointing:  # each layer's (fp32) input, and one layer's activations
            acts = tokens * spec.hidden_size * 4 * layers + layer
        else:
            acts = layer * layers
        return self.resident(spec, layout, True, work) + acts + scoring_bytes(spec, tokens)
