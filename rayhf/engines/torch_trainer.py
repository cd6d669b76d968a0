"""Training on rayhf's own engine: AdamW over this rank's shards.

Every rank of a data-parallel replica runs the same algorithm code on the same batch and gets
the same outputs; gradients are averaged over the replicas before each optimizer step (in
buckets that overlap backward: ``rayhf.engines.grad_buckets``), and the clipping norm is taken
over the whole model (all tp shards, all pp stages).
With ``zero1`` the optimizer state is split over the replicas (torch's ZeroRedundancyOptimizer);
with ``offload`` it lives in host memory (``HostAdamW``).
The weights, their gradients and the optimizer state are fp32 at every precision (the forward
runs under autocast at bf16/fp16); fp16 scales the loss (torch's GradScaler) and skips a step
whose gradients overflow, on every rank of the model alike (the overflow is read from the
global gradient norm).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from rayhf.data.batch import PackedBatch
from rayhf.engines.collectives import DataParallel
from rayhf.engines.grad_buckets import GradBuckets
from rayhf.engines.rank_model import RankModel
from rayhf.engines.schedule import ScheduleConfig
from rayhf.errors import RayhfError
from rayhf.models.sharding import embedding_name
from rayhf.parallel.turns import BACKWARD

LossFn = Callable[[PackedBatch], tuple[torch.Tensor, dict[str, float]]]
Weight = Callable[[PackedBatch], float]  # what a loss averages over, counted in a batch


def response_tokens(batch: PackedBatch) -> float:
    """What a token-mean loss averages over: the trained response tokens of ``seq`` (each one
    predicted after the prompt; with a ``loss_mask``, a multi-turn sample's model tokens only,
    not the environment's); a batch without them (pairs) counts its samples."""
    if "loss_mask" in batch.tensors:
        return float(batch.tensors["loss_mask"].sum())
    if "seq" in batch.seqlens and "prompt_lens" in batch.tensors:
        return float(sum(batch.seqlens["seq"]) - int(batch.tensors["prompt_lens"].sum()))
    return float(batch.n_samples)


def samples(batch: PackedBatch) -> float:
    """What a per-sequence loss averages over."""
    return float(batch.n_samples)


def micro_batches(
    mb: PackedBatch, budget: int | None, weight: Weight
) -> list[tuple[PackedBatch, float]]:
    """``mb`` cut into micro-batches of at most ``budget`` sequence tokens, each with its share
    of the minibatch's loss (its ``weight`` over the minibatch's): a micro-batch's loss is a mean
    over its own ``weight``, so the shares' weighted sum of the losses is the mean over the
    minibatch's, and their gradients add up to its gradient (``global_scales`` then makes it
    the mean over every dp rank's)."""
    if budget is None:
        return [(mb, 1.0)]
    parts = mb.token_chunks(budget)
    total = weight(mb)
    return [(p, weight(p) / total if total else 1.0 / len(parts)) for p in parts]


def global_scales(
    comm: DataParallel, minibatches: Sequence[PackedBatch], weight: Weight, cp: int = 1
) -> list[float]:
    """Per minibatch, what this rank's loss (a mean over its own ``weight``) is multiplied by so
    that, once the replicas' gradients are averaged, the gradient is that of the mean over every
    rank's ``weight``: ``dp * mine / total``. A rank with an empty minibatch adds nothing and
    scales no one else's down; with one replica it is 1.

    With context parallelism (``cp`` > 1) the ``cp`` ranks of a group share their rows, so the
    total counts each row ``cp`` times, while the group's gradient is the sum of its ranks'
    (each carries its own tokens'): each rank's scale is ``cp`` times the share's."""
    if comm.size == 1:
        return [1.0] * len(minibatches)
    mine = torch.tensor(
        [weight(mb) if mb.n_samples else 0.0 for mb in minibatches], dtype=torch.float64
    )
    total = comm.all_reduce_sum(mine)
    return [
        float(cp * comm.size * m / t) if t > 0 else 0.0 for m, t in zip(mine, total, strict=True)
    ]


class NonFiniteGradients(RayhfError):
    """Too many optimizer steps in a row had a non-finite gradient."""


class OptimizerConfig(BaseModel):
    """AdamW settings of a trainable role."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    lr: float = Field(1e-4, gt=0)
    """AdamW's learning rate: the peak of ``schedule``."""
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    """Warm-up and decay of the rate over the run's steps (``rayhf.engines.schedule``)."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW's decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's moment decay rates."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon."""
    grad_clip: float = Field(1.0, gt=0)
    """Max global grad norm."""
    zero1: bool = False
    """Shard optimizer state over the data-parallel replicas (ZeRO stage 1)"""
    max_skipped_steps: int = Field(8, gt=0)
    """Optimizer steps in a row whose gradient is not finite (each skipped, the weights left as
    they were) before the run stops with an error."""
    router_aux_loss: float = Field(0.0, ge=0)
    """A Mixture-of-Experts model's load-balancing loss in the loss, times this (Switch
    Transformer's, as Hugging Face's ``load_balancing_loss_func`` computes it over a forward's
    MoE layers; its ``router_aux_loss_coef``, 0.001 for Qwen3-MoE and Mixtral): softmax
    routers."""
    router_z_loss: float = Field(0.0, ge=0)
    """The router z-loss (ST-MoE: the mean square of each token's router logsumexp, per MoE
    layer, summed over layers) in the loss, times this."""
    router_bias_rate: float = Field(0.0, ge=0)
    """A sigmoid router's score-correction bias (GLM-4.5's) moves by this after each step, up
    for each expert that took fewer tokens than the mean over the step's minibatch (every dp
    rank's), down for one that took more: DeepSeek-V3's balancing without an auxiliary
    loss (its rate: 0.001)."""


class Totals:
    """A train call's stats over its ``n`` minibatches on every dp rank: each stat's mean over
    the minibatches that gave it (an empty minibatch, which a rank with too few samples gets,
    says nothing of the loss), a ``*_max`` stat's largest value, and counts (``count``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.sums: dict[str, float] = {}  # each stat's sum / n, as the mean over all n
        self.seen: dict[str, float] = {}  # the minibatches (in shares of one) that gave it
        self.maxima: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, stats: dict[str, float], share: float = 1.0) -> None:
        """One minibatch's stats, or a ``share`` of its micro-batches' (each scaled by it)."""
        for k, v in stats.items():
            if k.endswith("_max"):
                self.maxima[k] = max(self.maxima.get(k, v), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * share / self.n
                self.seen[k] = self.seen.get(k, 0.0) + share

    def count(self, key: str) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + 1.0

    def reduced(self, comm: DataParallel) -> dict[str, float]:
        """The stats over every dp rank (counts: each rank's, as every rank counts alike)."""
        ranks = comm.all_gather_object((self.sums, self.seen, self.maxima, self.counts))
        mine: list[tuple[dict[str, float], ...]] = ranks  # type: ignore[assignment]
        out: dict[str, float] = {}
        for k in sorted(set().union(*(r[0] for r in mine))):
            total = sum(r[0].get(k, 0.0) for r in mine)
            seen = sum(r[1].get(k, 0.0) for r in mine)
            # no minibatch empty (a minibatch's micro-batch shares add up to 1 but for rounding):
            # the plain mean, as it was
            whole = math.isclose(seen, self.n * len(mine), rel_tol=1e-9)
            out[k] = total / len(mine) if whole else total * self.n / seen
        for k in set().union(*(r[2] for r in mine)):
            out[k] = max(r[2][k] for r in mine if k in r[2])
        for k in set().union(*(r[3] for r in mine)):
            out[k] = sum(r[3].get(k, 0.0) for r in mine) / len(mine)
        return out


@dataclass(eq=False)
class Reducers:
    """Gradient buckets over their groups, armed and finished together."""

    parts: list[GradBuckets]

    def holds(self, params: list[list[torch.nn.Parameter]]) -> bool:
        """Whether the buckets are still those of ``params`` (one list a part; empty: none)."""
        lists = [p for p in params if p]
        return len(lists) == len(self.parts) and all(
            b.holds(p) for b, p in zip(self.parts, lists, strict=True)
        )

    def close(self) -> None:
        for b in self.parts:
            b.close()

    def arm(self) -> None:
        for b in self.parts:
            b.arm()

    def finish(self) -> None:
        for b in self.parts:
            b.finish()


class TorchTrainer:
    """AdamW steps over a ``RankModel``'s shards (``engine: torch``)."""

    name = "torch"
    gathers_over_dp = False  # every replica holds the whole model: saving needs replica 0 only

    def __init__(self, model: RankModel, cfg: OptimizerConfig, offload: bool = False) -> None:
        self.model, self.cfg = model, cfg
        self.groups = model.groups
        model.module.balancing = cfg.router_aux_loss > 0 or cfg.router_z_loss > 0
        model.module.balances_bias = cfg.router_bias_rate > 0
        self.comm = DataParallel(self.groups.dp_group)
        self.host = HostAdamW(_trained(model.module), cfg) if offload else None
        self.optimizer = (
            _make_optimizer(model.module, cfg, self.groups.dp_group)
            if self.host is None
            else self.host.optimizer
        )
        fp16 = model.numerics.autocast == torch.float16
        self.scaler = torch.amp.GradScaler(model.device.type) if fp16 else None
        self.buckets: Reducers | None = None
        self.skipped_in_a_row = 0  # optimizer steps whose gradient was not finite

    def train(
        self,
        minibatches: Sequence[PackedBatch],
        loss_fn: LossFn,
        token_budget: int | None = None,
        weight: Weight = response_tokens,
    ) -> dict[str, float]:
        """One optimizer step per minibatch; returns the mean of each stat over minibatches.

        ``minibatches`` has the same length on every dp rank (a rank with no samples for one
        passes an empty batch and contributes zero gradient), so the all-reduces line up. With a
        ``token_budget`` each minibatch's gradient accumulates over its micro-batches
        (``micro_batches``: each loss scaled by its share), before the one step.
        """
        module, pipe = self.model.module, self.model.pipe
        module.train(True)
        pipe.record = True
        totals = Totals(len(minibatches))
        reducer = self._reducer()
        scales = global_scales(self.comm, minibatches, weight, self.groups.cp)
        # with experts split over ep ranks, a rank's passes may be fewer than its group's others
        # (``Turns``): buckets wait for the drain, which adds to the experts' gradients
        overlap = self.groups.pp == 1 and self.groups.ep == 1
        try:
            self.model.ep_drain()  # the others' passes before this call trained, if any
            first = True
            for mb, scale in zip(minibatches, scales, strict=True):
                self._zero_grad()
                parts = micro_batches(mb, token_budget, weight) if mb.n_samples else []
                if token_budget is not None:  # how many the budget cut, per minibatch
                    totals.add({"micro_batches": float(len(parts))})
                for i, (part, share) in enumerate(parts):
                    # the last backward of the minibatch reduces buckets as it fills them
                    # (with pp > 1 a minibatch runs one backward per pipeline micro-batch)
                    if reducer is not None and i == len(parts) - 1 and overlap:
                        reducer.arm()
                    module.router_sums.clear()  # (a recompute in the last backward adds some)
                    loss, stats = loss_fn(part)
                    if module.balancing:  # an MoE model's load-balancing losses
                        balance, values = module.take_balance_losses(
                            self.cfg.router_aux_loss, self.cfg.router_z_loss
                        )  # over this rank's tokens: a cp group's mean of them
                        loss, stats = loss + balance / self.groups.cp, {**stats, **values}
                    self.model.turns.take(BACKWARD)
                    self._backward(loss * (share * scale))
                    pipe.backward_pending()
                    totals.add(stats, share)
                self.model.ep_drain()
                load = module.take_expert_loads()
                if load is not None:  # an MoE model's: the busiest expert over the mean
                    totals.add({"expert_load_max_over_mean": load})
                checks = module.take_route_checks()
                if first:  # before this call's first update: the weights that generated
                    totals.add(checks)
                first = False
                if reducer is not None:
                    reducer.finish()
                self._sum_tied_grads()
                if self.scaler is not None:
                    self.scaler.unscale_(self.optimizer)
                norm = self._clip_grads(self.cfg.grad_clip)
                totals.add({"grad_norm": norm})
                self._step(norm, totals)
                if module.balances_bias:
                    module.update_correction_biases(self.cfg.router_bias_rate, self.groups.dp_group)
            self.model.changed()
        finally:
            pipe.record = False
            pipe.pending.clear()
            module.train(False)
        return totals.reduced(self.comm)

    def _backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def _step(self, norm: float, totals: Totals) -> None:
        """The optimizer step, skipped on every rank (the global gradient norm is the same on
        each) when the gradient is not finite, at any precision: the weights and the optimizer
        state stay as they were, ``skipped_steps`` counts it, and ``max_skipped_steps`` in a
        row stop the run. With fp16 loss scaling the scale backs off then, and is logged; an
        overflow at a scale above 1 is the scaler finding its scale, not counted in a row."""
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        if self.scaler is not None:
            totals.add({"loss_scale": scale})
        if not math.isfinite(norm):
            totals.count("skipped_steps")
            self.skipped_in_a_row += 1 if scale <= 1.0 else 0
            self._zero_grad()
            if self.scaler is not None:
                self.scaler.update(scale * self.scaler.get_backoff_factor())
            if self.skipped_in_a_row >= self.cfg.max_skipped_steps:
                raise NonFiniteGradients(
                    f"{self.skipped_in_a_row} optimizer steps in a row had a non-finite gradient "
                    "(each skipped, the weights unchanged); lower optimizer.lr, check the loss "
                    "and the rewards, or raise optimizer.max_skipped_steps"
                )
            return
        self.skipped_in_a_row = 0
        if self.host is not None:
            self.host.step()
            return
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)  # every local gradient is finite: it steps
        self.scaler.update()

    def _zero_grad(self) -> None:
        """The model's gradients to 0 (kept: the buckets hold views of them)."""
        if self.host is None:
            self.optimizer.zero_grad(set_to_none=False)
            return
        for p in self.host.params:
            if p.grad is not None:
                p.grad.zero_()

    def _reducer(self) -> Reducers | None:
        """The dp replicas' gradient buckets (None: one replica), built again if a parameter
        was replaced or its gradient dropped since the last call. With ep > 1 the routed
        experts' gradients have their own: summed over the ranks that hold the same experts,
        divided by every replica (their tokens came from the whole ep group)."""
        groups = self.groups
        if groups.dp_group is None:
            return None
        module = self.model.module
        split = groups.ep > 1
        held = {id(module.param(n)) for n, p in module.shards.items() if p.expert and split}
        trained = _trained(module)
        experts = [p for p in trained if id(p) in held]
        dense = [p for p in trained if id(p) not in held]
        if self.buckets is None or not self.buckets.holds([dense, experts]):
            if self.buckets is not None:
                self.buckets.close()
            self.buckets = Reducers([GradBuckets(dense, groups.dp_group)])
            if experts:
                edp = GradBuckets(experts, groups.expert_dp_group, divisor=groups.dp)
                self.buckets.parts.append(edp)
        return self.buckets

    def _sum_tied_grads(self) -> None:
        """A tied embedding held by the first and the last stage: both copies take the sum of
        their gradients (lookup and head), so they stay equal after every step."""
        module = self.model.module
        group = self.groups.ends_group
        if not module.spec.tied or group is None:
            return
        p = module.param(embedding_name(module.spec))
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)

    def _clip_grads(self, max_norm: float) -> float:
        """Scale gradients so the whole model's gradient norm is at most ``max_norm``.

        A tp-replicated parameter has the same gradient on every tp rank, so it is counted once.
        The norms are torch's foreach ones and the scaling is a tensor op, so the step reads
        the device once, for the returned norm.
        """
        module = self.model.module
        sharded: list[torch.Tensor] = []
        replicated: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []  # routed experts split over ep ranks
        params = module.local_state()
        for name, p in params.items():
            if p.grad is None or (module.tied_copy and name == embedding_name(module.spec)):
                continue  # a tied embedding's last-stage copy counts once, on the first stage
            shard = module.shards[name]
            whole = shard.tp_dim is None or self.groups.tp == 1
            if shard.expert and self.groups.ep > 1:
                experts.append(p.grad.detach())
            else:
                (replicated if whole else sharded).append(p.grad.detach())
        zero = torch.zeros((), dtype=torch.float32, device=self.model.device)
        norms = (sharded, replicated, experts)
        square = [get_total_norm(g).float().square() if g else zero for g in norms]
        if self.groups.ep_group is not None:  # each ep rank's experts are its own
            dist.all_reduce(square[2], group=self.groups.ep_group)
        square[0] = square[0] + square[2]  # split by tp too
        if self.groups.tp_group is not None:
            dist.all_reduce(square[0], group=self.groups.tp_group)
        total = square[0] + square[1]
        if self.groups.pp_group is not None:
            dist.all_reduce(total, group=self.groups.pp_group)
        norm = total.sqrt()
        grads = [p for p in params.values() if p.grad is not None]
        clip_grads_with_norm_(grads, max_norm, norm)  # a no-op factor of 1 below max_norm
        return float(norm)

    def weights_loaded(self) -> None:
        """Weights written into the shards from outside (the optimizer steps them as they are;
        offloaded, its host copy takes them)."""
        if self.host is not None:
            self.host.pull()

    def shard_source(self) -> RankModel:
        """What a move out of this rank's layout reads: the shards themselves."""
        return self.model

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole on this rank meanwhile (they already are)."""
        yield

    def save_optimizer(self, path: str) -> dict[str, Any]:
        """This rank's optimizer state (and fp16 loss scale), to store in the rank's checkpoint
        file."""
        state = getattr(self.optimizer, "optim", self.optimizer).state_dict()  # ZeRO-1: its part
        if self.scaler is not None:
            state = {**state, "grad_scaler": self.scaler.state_dict()}
        return state

    def load_optimizer(self, path: str, state: dict[str, Any]) -> None:
        state = dict(state)
        scaler = state.pop("grad_scaler", None)
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        getattr(self.optimizer, "optim", self.optimizer).load_state_dict(state)


def _make_optimizer(
    module: torch.nn.Module, cfg: OptimizerConfig, dp_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    kwargs = _adamw_settings(cfg)
    trained = _trained(module)
    if cfg.zero1 and dp_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(
            trained, optimizer_class=torch.optim.AdamW, process_group=dp_group, **kwargs
        )
    return torch.optim.AdamW(trained, **kwargs)


def _adamw_settings(cfg: OptimizerConfig) -> dict[str, Any]:
    return {
        "lr": cfg.lr,
        "betas": cfg.betas,
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": True,  # one kernel over every tensor, on CUDA and CPU (docs/decisions/)
    }


def _trained(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]  # not a router's bias


class HostAdamW:
    """AdamW whose state and fp32 copy of the weights live in host memory (pinned, on CUDA):
    a step sends the device's gradients there, steps the copy and sends it back into the
    device's weights. On CPUs the copy is a second tensor in the same memory, the same steps."""

    def __init__(self, params: list[torch.nn.Parameter], cfg: OptimizerConfig) -> None:
        self.params = params
        self.cuda = any(p.device.type == "cuda" for p in params)  # pinned copies, async moves
        self.copies = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in params
        ]
        for c in self.copies:
            c.grad = torch.zeros(c.shape, pin_memory=self.cuda)
            if self.cuda:
                c.data = c.data.pin_memory()
        self.optimizer = torch.optim.AdamW(self.copies, **_adamw_settings(cfg))

    def step(self) -> None:
        for p, c in zip(self.params, self.copies, strict=True):
            assert c.grad is not None
            if p.grad is None:
                c.grad.zero_()
            else:
                c.grad.copy_(p.grad, non_blocking=True)
        if self.cuda:  # the gradients are on the host before AdamW reads them
            torch.cuda.synchronize()
        self.optimizer.step()
        for p, c in zip(self.params, self.copies, strict=True):
            p.data.copy_(c, non_blocking=True)

    def pull(self) -> None:
        """The device's weights into the host copy (written there from outside)."""
        for p, c in zip(self.params, self.copies, strict=True):
            c.data.copy_(p.detach())
