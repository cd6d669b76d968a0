"""Analytic cost model: a call's time and peak memory per device under a layout, from FLOPs and
bytes (model shape x workload) and the device's rates. Pure arithmetic, no Ray.

It models rayhf's own execution, not an idealized one:
- compute: 2 FLOPs per parameter per token forward (+ causal attention), x3 for forward and
  backward; pipeline stages run GPipe, so a call takes ``(n_mbs + pp - 1) / n_mbs`` times one
  stage's share; tp adds two all-reduces per layer forward (four with backward);
- training: one gradient all-reduce over dp and one AdamW step per minibatch;
- generation: prefill is a forward pass; each decode step walks the stages one after another
  (decode is not micro-batched), reading every weight shard and the KV cache once;
- memory: weights, gradients and AdamW state (fp32 master + two moments, sharded over dp with
  ZeRO-1), activations of every micro-batch in flight (GPipe), the KV cache, and the full logits
  of a replica's batch (rayhf gathers logits over tp).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Literal

from rayhf.models.sharding import param_shards, shard_numel
from rayhf.models.spec import ModelSpec
from rayhf.planner.hardware import ClusterSpec
from rayhf.planner.layout import Layout

ACTIVATION_BYTES_PER_HIDDEN = 34  # per token per layer per hidden unit, bf16 (Megatron, no
# recomputation: Korthikanti et al. 2022, "Reducing Activation Recomputation", eq. 2)


@dataclass(frozen=True)
class Workload:
    """What one call computes in one step."""

    kind: Literal["generate", "inference", "train"]
    n_seqs: int  # sequences in the step's batch
    prompt_len: int
    gen_len: int  # new tokens (generate); inference and train see prompt + gen tokens
    n_minibatches: int = 1  # optimizer steps per train call


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak the kernels reach (fit by profiling on a machine at hand)."""

    compute: float = 0.45
    memory: float = 0.7


@dataclass(frozen=True)
class CallCost:
    seconds: float
    memory: float  # peak bytes on the busiest device of the mesh during the call
    parts: dict[str, float] = field(default_factory=dict)  # seconds by component


@functools.lru_cache(maxsize=4096)
def max_shard_params(spec: ModelSpec, tp: int, pp: int) -> int:
    """Parameters on the fullest device of a ``tp x pp`` layout."""
    return max(shard_numel(spec, tp, pp, 0, s) for s in range(pp))


@functools.lru_cache(maxsize=256)
def _sizes(spec: ModelSpec) -> tuple[int, int, int]:
    """(all parameters, parameters a token's forward multiplies, embedding parameters)."""
    total = embed = 0
    for p in param_shards(spec):
        total += p.numel
        if p.unit == 0:
            embed += p.numel
    return total, total - embed, embed


def _allreduce(n_bytes: float, n: int, bandwidth: float, latency: float) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * n_bytes / bandwidth + latency


class AnalyticCost:
    """Costs from FLOPs and bytes on ``cluster``'s devices."""

    def __init__(self, cluster: ClusterSpec, efficiency: Efficiency | None = None) -> None:
        self.cluster = cluster
        self.eff = efficiency or Efficiency()

    def _flops_rate(self) -> float:
        return self.cluster.device.flops * self.eff.compute

    def _bytes_rate(self) -> float:
        return self.cluster.device.memory_bandwidth * self.eff.memory

    def _tp_bandwidth(self, layout: Layout) -> float:
        return self.cluster.bandwidth(layout.mesh[: layout.tp])

    def forward_seconds(self, spec: ModelSpec, layout: Layout, n_seqs: int, seq: int) -> float:
        """One forward over a replica's ``n_seqs`` sequences of ``seq`` tokens, per device."""
        _, matmul, _ = _sizes(spec)
        tokens = n_seqs * seq
        flops = tokens * (2 * matmul + 2 * spec.n_layers * spec.hidden_size * seq)
        compute = flops / (layout.tp * layout.pp) / self._flops_rate()
        act = tokens * spec.hidden_size * self.cluster.device.dtype_bytes
        per_layer = _allreduce(
            act, layout.tp, self._tp_bandwidth(layout), self.cluster.link_latency
        )
        comm = 2 * spec.n_layers / layout.pp * per_layer
        bubble = (layout.n_mbs + layout.pp - 1) / layout.n_mbs
        return (compute + comm) * bubble

    def decode_seconds(self, spec: ModelSpec, layout: Layout, n_seqs: int, ctx: int) -> float:
        """One decode step (one token per row, ``ctx`` tokens in the cache), stages in turn."""
        _, matmul, _ = _sizes(spec)
        b = self.cluster.device.dtype_bytes
        weights = matmul * b / layout.tp
        kv = 2 * spec.n_layers * n_seqs * ctx * spec.n_kv_heads * spec.head_dim * b / layout.tp
        compute = 2 * matmul * n_seqs / layout.tp / self._flops_rate()
        memory = (weights + kv) / self._bytes_rate()
        lat = self.cluster.link_latency
        comm = (2 * spec.n_layers * lat if layout.tp > 1 else 0.0) + (layout.pp - 1) * lat
        return max(compute, memory) + comm

    def call(self, spec: ModelSpec, layout: Layout, work: Workload, zero1: bool = False):
        """Time and peak memory of one call of ``work`` on ``layout``."""
        n_seqs = math.ceil(work.n_seqs / layout.dp)
        seq = work.prompt_len + work.gen_len
        parts: dict[str, float] = {}
        if work.kind == "generate":
            parts["prefill"] = self.forward_seconds(spec, layout, n_seqs, work.prompt_len)
            mid_ctx = work.prompt_len + work.gen_len // 2
            parts["decode"] = work.gen_len * self.decode_seconds(spec, layout, n_seqs, mid_ctx)
        elif work.kind == "inference":
            parts["forward"] = self.forward_seconds(spec, layout, n_seqs, seq)
        else:
            parts["forward_backward"] = 3 * self.forward_seconds(spec, layout, n_seqs, seq)
            parts["optimizer"] = work.n_minibatches * self._optimizer_seconds(spec, layout)
        return CallCost(sum(parts.values()), self.memory(spec, layout, work, zero1), parts)

    def _optimizer_seconds(self, spec: ModelSpec, layout: Layout) -> float:
        """Gradient all-reduce over dp plus one AdamW pass over this device's shard."""
        shard = max_shard_params(spec, layout.tp, layout.pp)
        grads = shard * self.cluster.device.dtype_bytes
        dp_devices = layout.mesh[:: layout.tp * layout.pp]
        reduce = _allreduce(
            grads, layout.dp, self.cluster.bandwidth(dp_devices), self.cluster.link_latency
        )
        return reduce + 2 * 16 * shard / self._bytes_rate()

    def resident(self, spec: ModelSpec, layout: Layout, trainable: bool, zero1: bool = False):
        """Bytes a role keeps on each device of its home layout between calls."""
        shard = max_shard_params(spec, layout.tp, layout.pp)
        b = self.cluster.device.dtype_bytes
        if not trainable:
            return shard * b
        optimizer = 8 * shard if b == 4 else 12 * shard  # fp32: 2 moments; bf16: + fp32 master
        return shard * 2 * b + optimizer / (layout.dp if zero1 else 1)

    def memory(self, spec: ModelSpec, layout: Layout, work: Workload, zero1: bool = False):
        """Peak bytes on a device while the call runs, its weights included."""
        b = self.cluster.device.dtype_bytes
        n_seqs = math.ceil(work.n_seqs / layout.dp)
        seq = work.prompt_len + work.gen_len
        layers = math.ceil(spec.n_layers / layout.pp)
        logits = 0.0 if spec.value_head else n_seqs * seq * spec.vocab_size * 4
        if work.kind == "generate":
            kv = 2 * layers * n_seqs * seq * spec.n_kv_heads * spec.head_dim * b / layout.tp
            transient = kv + n_seqs * spec.vocab_size * 4
            return self.resident(spec, layout, False) + transient
        if work.kind == "inference":
            tokens = n_seqs * seq / layout.n_mbs
            acts = tokens * spec.hidden_size * ACTIVATION_BYTES_PER_HIDDEN * b / 2 / layout.tp
            return self.resident(spec, layout, False) + acts + logits
        tokens = n_seqs * seq / work.n_minibatches
        acts = tokens * spec.hidden_size * ACTIVATION_BYTES_PER_HIDDEN * b / 2 * layers / layout.tp
        return self.resident(spec, layout, True, zero1) + acts + logits / work.n_minibatches
