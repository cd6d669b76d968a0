"""Profiled cost model: timings of rayhf's own engine on this machine, fitted into a call's cost
under any layout. The planner only consumes the numbers; ``rayhf.runtime.profiling`` measures.

    timings -- for the model at depth 1 and depth 2 layers (a hybrid's: one and two periods of
        its layer kinds), the engine's forward, train step (forward, backward, AdamW) and
        generation (prefill + decode) over the grids below, in one process with one emulated
        device's threads
    -> fit_profile: least-squares fit per op (``OpFit``: seconds = coefficients . features); the
       deeper fit minus the shallower one is one layer (a hybrid's: the mean of its kinds),
       the rest is the embedding, head and per-call Python
    -> cached as JSON per (model shape, threads, torch version)

``ProfiledCost`` composes those per-layer times under a layout the way rayhf executes it (the
same rules as ``AnalyticCost``: dp splits the batch and all-reduces gradients, tp divides a
layer's token work and adds two all-reduces per layer forward, pp runs GPipe over micro-batches
and generation walks the stages in turn) and adds the driver's per-call cost. Memory stays
analytic (``AnalyticCost.memory``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Any

import numpy as np

from rayhf.models.sharding import param_shards
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import AnalyticCost, CallCost, Rows, Workload, max_trained_params
from rayhf.planner.hardware import CPU_ZERO3_PER_TENSOR, ClusterSpec

# (batch, sequence) points for forward and train; (batch, prompt, new tokens) for generation
GRID = [(4, 16), (16, 16), (32, 16), (4, 48), (16, 48), (32, 48)]
GEN_GRID = [(4, 16, 4), (16, 16, 4), (32, 16, 4), (4, 16, 16), (16, 16, 16), (32, 16, 16),
            (16, 8, 4), (16, 32, 4)]  # fmt: skip
# the same on a GPU, where the CPU's points are too small to time anything but launches
GPU_GRID = [(8, 128), (32, 128), (64, 128), (8, 512), (32, 512), (64, 512)]
GPU_GEN_GRID = [(8, 64, 32), (32, 64, 32), (64, 64, 32), (8, 64, 128), (32, 64, 128),
                (64, 64, 128), (32, 32, 32), (32, 256, 32)]  # fmt: skip
Timing = tuple[int, tuple[int, ...], float]  # (model depth, grid point, seconds)
# What the engine's timings mean: bumped when its execution changes (2: the static decode
# step of rayhf.parallel.decode; 3: train steps score through the sliced LM head; 4: CPU decode
# steps multiply packed weights from 2^16 elements; 5: a hybrid timed over whole periods of its
# layer kinds), so profiles cached before are measured again.
ENGINE_REVISION = 5


@dataclasses.dataclass(frozen=True)
class OpFit:
    """Seconds of one op as ``base + n_layers * layer`` coefficient vectors over its features:
    forward/train ``(1, tokens, tokens x seq)``; generate ``(1, prompt tokens, new tokens,
    new tokens x batch)``."""

    base: tuple[float, ...]
    layer: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    key: str
    threads: int
    forward: OpFit
    train: OpFit
    generate: OpFit

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        raw = json.loads(text)
        ops = {k: OpFit(tuple(raw[k]["base"]), tuple(raw[k]["layer"])) for k in OPS}
        return cls(raw["key"], raw["threads"], **ops)


OPS = ("forward", "train", "generate")


def profile_key(spec: ModelSpec, threads: int, torch_version: str, device: str = "cpu") -> str:
    """What a profile depends on: the model's shape except its depth, threads, torch, the
    device it was timed on (``cpu`` or the GPU's name) and the engine's revision."""
    shape = dataclasses.asdict(dataclasses.replace(spec, n_layers=0))
    text = json.dumps([shape, threads, torch_version, ENGINE_REVISION, device], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _features(op: str, point: tuple[int, ...]) -> list[float]:
    if op == "generate":
        b, p, g = point
        return [1.0, b * p, g, g * b]
    b, s = point
    return [1.0, b * s, b * s * s]


def _fit_nonnegative(rows: list[list[float]], seconds: list[float]) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the features that come out
    negative until none does (times never shrink as work grows)."""
    a, y = np.array(rows), np.array(seconds)
    keep = np.ones(a.shape[1], dtype=bool)
    coef = np.zeros(a.shape[1])
    while keep.any():
        sub, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sub >= 0).all():
            coef[keep] = sub
            break
        keep[np.flatnonzero(keep)[sub < 0]] = False
    return coef


def fit_profile(key: str, threads: int, timings: dict[str, list[Timing]]) -> ModelProfile:
    """Fit each op's measured ``(depth, grid point, seconds)`` timings: ``seconds = base .
    features + depth x layer . features`` with non-negative coefficients (the depth-2 times
    minus the depth-1 times are one layer, the rest is the embedding, head and Python)."""
    ops = {}
    for op in OPS:
        n = 4 if op == "generate" else 3
        rows = [
            _features(op, point) + [depth * f for f in _features(op, point)]
            for depth, point, _ in timings.get(op, [])
        ]
        secs = [seconds for *_, seconds in timings.get(op, [])]
        coef = _fit_nonnegative(rows, secs) if rows else np.zeros(2 * n)
        ops[op] = OpFit(tuple(coef[:n].tolist()), tuple(coef[n:].tolist()))
    return ModelProfile(key, threads, **ops)


def _dot(coef: tuple[float, ...], feats: list[float]) -> float:
    return float(sum(c * f for c, f in zip(coef, feats, strict=True)))


class ProfiledCost(AnalyticCost):
    """Call times from measured profiles; memory and reallocation from the analytic model.

    Measured constants of the runtime complete it (``calibrate`` fits them from runs):
    ``call_overhead``, the driver's cost of one call (dispatch, splitting and joining the batch,
    Ray), and ``actor``, by the number of devices a call keeps busy, ``(fixed, scale)``: a call
    inside a role-group actor takes ``fixed + scale x`` its in-process profile (the fixed part
    is the interface's own work per call, the scale what Ray's threads and cores shared with
    the call's peers cost).
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        profiles: dict[ModelSpec, ModelProfile],
        call_overhead: float = 0.0,
        actor: dict[int, tuple[float, float]] | None = None,
        zero3_per_tensor: float = CPU_ZERO3_PER_TENSOR,
    ) -> None:
        super().__init__(cluster)
        self.profiles = profiles
        self.call_overhead = call_overhead
        self.actor = actor or {}
        self.zero3_per_tensor = zero3_per_tensor
        self._still: ProfiledCost | None = None  # the same with links that answer at once

    def runtime(self, layout: Layout) -> tuple[float, float]:
        """(fixed seconds, scale) of a call on ``layout`` inside the actors."""
        if not self.actor:
            return 0.0, 1.0
        return self.actor.get(min(layout.world_size, max(self.actor)), (0.0, 1.0))

    def _profile(self, spec: ModelSpec) -> ModelProfile:
        return self.profiles[dataclasses.replace(spec, n_layers=0, lora=None)]

    def _allreduce(self, n_bytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        bw = self.cluster.intra_node_bandwidth
        return 2 * (n - 1) / n * n_bytes / bw + self.cluster.link_latency

    def _zero3_seconds(self, spec: ModelSpec, shard: float, dp: int) -> float:
        """ZeRO-3's cost per minibatch on gloo over ZeRO-2's: the volume of one all-gather of
        the weights (DeepSpeed's prefetch and bucketing threads hide the second gather and the
        gradients' reduce-scatter) and a fixed cost per weight tensor."""
        if dp <= 1:
            return 0.0
        volume = (dp - 1) / dp * shard / self.cluster.intra_node_bandwidth
        return volume + _n_tensors(spec) * self.zero3_per_tensor

    def _stage_pass(self, fit: OpFit, spec: ModelSpec, lay: Layout, mb: Rows, train: bool) -> float:
        """One micro-batch ``mb`` through one stage: its layers' token work split over tp, their
        per-layer fixed cost not, two all-reduces per layer forward (four with backward), the
        rest of the model (embedding, head) on the whole replica; with ``lay.cp`` > 1, on this
        device's ``1/cp`` of the tokens, attention's exchanges added."""
        seq = mb.seq
        tokens = mb.n_seqs * seq / lay.cp
        feats = [1.0, tokens, tokens * seq]
        layers = math.ceil(spec.n_layers / lay.pp)
        work = fit.layer[0] + _dot(fit.layer[1:], feats[1:]) / lay.tp
        comm = (4 if train else 2) * self._allreduce(tokens * spec.hidden_size * 4, lay.tp)
        comm += self.exchange_seconds(spec, lay, tokens, train)
        comm += self.context_seconds(spec, lay, tokens, train)
        return layers * (work + comm) + _dot(fit.base, feats) / lay.pp

    def _pipeline(self, fit: OpFit, spec: ModelSpec, lay: Layout, rows: Rows, train: bool) -> float:
        """GPipe over the micro-batches of ``rows``, activations hopping between stages, and the
        gather of the vocab-parallel logits (and its gradient) over tp."""
        n_seqs, seq = rows.n_seqs, rows.seq
        mbs = min(lay.n_microbatches, max(1, n_seqs))
        stage = self._stage_pass(fit, spec, lay, Rows(n_seqs / mbs, seq), train)
        hop = self.cluster.link_latency + n_seqs / mbs * seq / lay.cp * spec.hidden_size * 4 / (
            self.cluster.intra_node_bandwidth
        )
        passes = 2 if train else 1
        gather = 0.0
        if lay.tp > 1 and not spec.value_head:
            logits = n_seqs * seq * spec.vocab_size * 4
            gather = passes * self._allreduce(logits / 2, lay.tp)
        return (mbs + lay.pp - 1) * stage + passes * (lay.pp - 1) * mbs * hop + gather

    def _adapters_share(self, spec: ModelSpec, layout: Layout, rows: Rows) -> float:
        """A LoRA role's forward and backward over the same role's in full, as the analytic
        model prices both (the profile times a model that trains in full)."""
        whole = dataclasses.replace(spec, lora=None)
        lora = self.forward_seconds(spec, layout, rows, True)
        return lora / self.forward_seconds(whole, layout, rows, True)

    def _generate(self, prof: ModelProfile, spec: ModelSpec, lay: Layout, b: int, w: Workload):
        """Prefill through the pipeline, then every new token walks all stages in turn."""
        fit = prof.generate
        per_token = fit.layer[2] + fit.layer[3] * b / lay.tp
        lat = self.cluster.link_latency
        comm = 2 * lat if lay.tp > 1 else 0.0
        decode = spec.n_layers * (per_token + comm) + fit.base[2] + fit.base[3] * b
        decode += (lay.pp - 1) * lat
        prefill = fit.base[0] + fit.base[1] * b * w.prompt_len
        prefill += spec.n_layers * (fit.layer[0] + fit.layer[1] * b * w.prompt_len / lay.tp)
        return prefill + w.gen_len * decode

    def _call(self, spec: ModelSpec, layout: Layout, work: Workload) -> CallCost:
        """The call's profiled parts under the runtime's constants; its ``waits``, what the
        links' latency and ZeRO-3's per-tensor fetches add (the parts priced without them)."""
        seconds, parts = self._parts(spec, layout, work)
        if self._still is None:
            instant = dataclasses.replace(self.cluster, link_latency=0.0)
            self._still = ProfiledCost(instant, self.profiles, zero3_per_tensor=0.0)
        fixed, scale = self.runtime(layout)
        waits = (seconds - self._still._parts(spec, layout, work)[0]) * scale
        parts = {k: v * scale for k, v in parts.items()}
        parts["actor"] = fixed
        parts["driver"] = self.call_overhead
        return CallCost(sum(parts.values()), self.memory(spec, layout, work), parts, waits)

    def _parts(
        self, spec: ModelSpec, layout: Layout, work: Workload
    ) -> tuple[float, dict[str, float]]:
        """The profiled seconds of a call (before the runtime's constants), by part."""
        prof = self._profile(spec)
        n_seqs = math.ceil(work.n_seqs / layout.batch_groups)  # a cp group's ranks share theirs
        seq = work.prompt_len + work.gen_len
        parts: dict[str, float] = {}
        if work.kind == "generate":
            parts["generate"] = self._generate(prof, spec, layout, n_seqs, work)
        elif work.kind == "inference":
            parts["forward"] = self._pipeline(prof.forward, spec, layout, Rows(n_seqs, seq), False)
        else:
            per_mb = math.ceil(n_seqs / work.n_minibatches)
            step = self._pipeline(prof.train, spec, layout, Rows(per_mb, seq), True)
            if spec.lora is not None:  # profiled in full; frozen weights get no gradients
                step *= self._adapters_share(spec, layout, Rows(per_mb, seq))
            shard = max_trained_params(spec, layout.tp, layout.pp, layout.ep) * 4
            sync = self._allreduce(shard, layout.dp)
            if work.zero_stage >= 3:  # beside the gradients' reduction, as at stages 1-2
                sync += self._zero3_seconds(spec, shard, layout.dp)
            parts["train"] = work.epochs * work.n_minibatches * (step + sync)
            if work.forward_share:  # e.g. decoupled PPO's proximal log-probs
                share = math.ceil(n_seqs * work.forward_share)
                share_rows = Rows(share, seq)
                parts["forward"] = self._pipeline(prof.forward, spec, layout, share_rows, False)
        return sum(parts.values()), parts


@functools.lru_cache(maxsize=256)
def _n_tensors(spec: ModelSpec) -> int:
    return len(param_shards(spec))


@dataclasses.dataclass(frozen=True)
class MeasuredRun:
    """What a run of a plan measured: mean step seconds and compute seconds per call (inside
    the actors, the slowest rank)."""

    plan: Any  # rayhf.planner.plan.Plan
    step_seconds: float
    compute_seconds: dict[str, float]


def calibrate(cost: ProfiledCost, graph, samples) -> ProfiledCost:
    """``cost`` with its runtime constants fitted to measured runs. ``samples`` are
    ``(specs, works, run)``, one per run, of one or more models (``cost`` holds their profiles).
    Per mesh size, a non-negative least-squares line through (profiled, measured) compute of
    every model call: its intercept is the in-actor cost per call, its slope the scale; the
    driver's cost per call is the step time no actor accounts for, per call."""
    bare = ProfiledCost(cost.cluster, cost.profiles)
    points: dict[int, list[tuple[float, float]]] = {}
    overheads = []
    for specs, works, run in samples:
        for name in graph.order:
            role, lay = graph.by_name[name].role, run.plan.layouts[name]
            if role in specs:
                profiled = bare.call(specs[role], lay, works[name]).parts
                compute = sum(v for k, v in profiled.items() if k not in ("actor", "driver"))
                points.setdefault(lay.world_size, []).append((compute, run.compute_seconds[name]))
        outside = run.step_seconds - sum(run.compute_seconds.values())
        overheads.append(outside / len(graph.order))
    actor = {}
    for k, pts in points.items():
        fixed, scale = _fit_nonnegative([[1.0, x] for x, _ in pts], [y for _, y in pts])
        actor[k] = (float(fixed), float(scale))
    return ProfiledCost(cost.cluster, cost.profiles, sum(overheads) / len(overheads), actor)
