"""GRPO and Dr. GRPO: ``GRPOConfig``, the loss as pure torch functions, and ``grpo_actor``.

GRPO is PPO's clipped surrogate with a group baseline. Each prompt is sampled ``group_size``
times. A sample's advantage is its score relative to the other samples of its prompt, shared by
all of its tokens, so no critic is trained:

    scores, group_ids                         --grpo_advantages---> advantages [B]
    logprobs, old, ref logprobs, advantages   --grpo_loss---------> surrogate + kl_coef * k3

Tensor conventions are those of ``rayhf.algorithms.ppo``: right-padded ``[B, T]`` response tokens
with a bool ``mask``; empty rows contribute nothing and never produce NaN. GRPO is DeepSeekMath
(Shao et al., 2024); Dr. GRPO is "Understanding R1-Zero-Like Training" (Liu et al., 2025).

The ``grpo_actor`` interface samples ``group_size`` responses per prompt in its generate call;
its train call normalizes each score within its prompt's group over the *whole* data-parallel
batch (the groups' members may sit on different ranks), then takes clipped-surrogate steps with
a k3 KL term.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, cast

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.interface import Algorithm, CallContext, CallEngine, WorkShape
from rayhf.algorithms.lm import (
    LMInterface,
    padded,
    response_forward,
    rollout_stats,
    sample_batch,
)
from rayhf.algorithms.offpolicy import (
    OffPolicyConfig,
    PolicyReference,
    behaviour_weights,
    bounded_ratio,
    policy_train_shape,
)
from rayhf.algorithms.ppo import agg_weight, aggregate, clipped_surrogate, masked_mean
from rayhf.data.batch import PackedBatch
from rayhf.engines.torch_trainer import Weight, samples
from rayhf.errors import RayhfError

KLEstimator = Literal["k1", "k2", "k3"]


class GRPOConfig(OffPolicyConfig):
    """Hyper-parameters of the GRPO loss and its group-relative advantages (and, inherited,
    how stale its samples may be)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["grpo"] = "grpo"
    """Selects this algorithm in the config's ``algorithm:`` section."""

    group_size: int = Field(4, gt=1)
    """Samples generated per prompt; each sample is compared with the others of its prompt."""
    kl_coef: float = Field(0.04, ge=0)
    """Weight of the per-token KL penalty against the reference policy, added to the loss."""
    kl_estimator: KLEstimator = "k3"
    """How that KL is estimated per token (``kl_loss_term``): ``k3`` (GRPO's, verl's
    ``low_var_kl``), ``k2`` or ``k1``."""
    eps_clip: float = Field(0.2, gt=0)
    """Policy ratio is clipped to ``[1 - eps_clip, 1 + eps_clip]``."""
    eps: float = Field(1e-6, gt=0)
    """Added to the group std, so a group whose scores are all equal gets advantage 0, not NaN."""
    dr_grpo: bool = False
    """Dr. GRPO: no division by the group std, and a loss summed over tokens then divided by a
    constant, so neither response length nor prompt difficulty reweights the samples."""
    max_new_tokens_norm: int | None = Field(None, gt=0)
    """Dr. GRPO's constant divisor per sequence; None: the generation's ``max_new_tokens`` (as
    TRL divides by its maximum completion length), a multi-turn call's ``env.max_tokens``."""
    n_minibatches: int = Field(4, gt=0)
    """Optimizer steps per epoch; the batch is split into this many minibatches."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each generated batch."""

    @model_validator(mode="after")
    def _one_aggregation(self) -> GRPOConfig:
        if self.dr_grpo and self.loss_agg != "token_mean":
            raise ValueError(
                "algorithm.loss_agg: Dr. GRPO sums tokens over a constant; leave loss_agg unset "
                "or set dr_grpo false"
            )
        return self

    def clip_range(self) -> tuple[float, float]:
        """The policy ratio's clip bounds below and above 1 (DAPO's differ)."""
        return self.eps_clip, self.eps_clip


def group_advantages(scores: Tensor, group_ids: Tensor, eps: float, scale: bool = True) -> Tensor:
    """Each score minus its group's mean, divided by ``std + eps`` of the group if ``scale``.

    Groups are found by id, so the samples of a prompt may sit anywhere in the batch. The std
    is the sample std (``n - 1`` divisor), as in DeepSeekMath's formula as implemented by TRL and
    verl, so ``eps`` and learning rates tuned there carry over. A group of one sample has no
    baseline to compare against and gets advantage 0.
    """
    assert scores.dim() == 1 and scores.shape == group_ids.shape, "need scores, group_ids [N]"
    x = scores if scores.is_floating_point() else scores.float()
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = x.new_zeros(n_groups).index_add_(0, group, torch.ones_like(x))
    mean = x.new_zeros(n_groups).index_add_(0, group, x) / count
    centered = x - mean[group]
    if scale:
        square_sum = x.new_zeros(n_groups).index_add_(0, group, centered**2)
        std = (square_sum / (count - 1).clamp(min=1)).sqrt()
        centered = centered / (std[group] + eps)
    return torch.where(count[group] < 2, torch.zeros_like(centered), centered)


def grpo_advantages(scores: Tensor, group_ids: Tensor, cfg: GRPOConfig) -> Tensor:
    """``group_advantages`` as ``cfg`` asks.

    Dr. GRPO does not divide by the std, which would up-weight prompts that are nearly always
    or nearly never solved, whose scores barely vary.
    """
    return group_advantages(scores, group_ids, cfg.eps, scale=not cfg.dr_grpo)


def over_groups(
    engine: CallEngine, batch: PackedBatch, rank: int, values: Tensor,
    fn: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:  # fmt: skip
    """``fn(values, group_ids)`` over every dp rank's samples (a prompt's group may be split
    across ranks), this rank's share of the result."""
    mine = (batch.tensors["group_ids"].long(), values)
    parts = cast(list[tuple[Tensor, Tensor]], engine.all_gather_object(mine))
    out = fn(torch.cat([p[1] for p in parts]), torch.cat([p[0] for p in parts]))
    start = sum(len(p[0]) for p in parts[:rank])
    return out[start : start + batch.n_samples]


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || ref): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Like the plain log-ratio it is unbiased on samples from the policy, but it is never negative
    and has lower variance (Schulman, "Approximating KL Divergence", 2020). Written as
    ``expm1(d) - d``: the literal formula rounds to small negatives near ``d = 0``. 0 on padding.
    """
    d = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
    return torch.expm1(d) - d


def kl_loss_term(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, how: KLEstimator) -> Tensor:
    """Per-token KL(policy || ref) as a loss term, by Schulman's estimator ``how``, ``d = logp -
    ref``: ``k1`` is ``d`` (its gradient is the score function's, unbiased only in a reward),
    ``k2`` is ``d**2 / 2`` (its gradient is that of k1 in the reward: OpenRLHF's
    REINFORCE++-baseline), ``k3`` is ``k3_kl`` (GRPO's). 0 on padding."""
    if how == "k3":
        return k3_kl(logprobs, ref_logprobs, mask)
    d = torch.where(mask, logprobs - ref_logprobs, torch.zeros_like(logprobs))
    return d if how == "k1" else 0.5 * d * d


def _aggregate(per_token: Tensor, mask: Tensor, cfg: GRPOConfig) -> Tensor:
    """``algorithm.loss_agg`` (``ppo.aggregate``); for Dr. GRPO the sum over
    ``B * max_new_tokens_norm``."""
    if not cfg.dr_grpo:
        return aggregate(per_token, mask, cfg.loss_agg)
    longest = int(mask.sum(dim=1).max()) if mask.numel() else 0
    norm = cfg.max_new_tokens_norm
    if norm is None or norm < longest:
        raise RayhfError(
            f"algorithm.max_new_tokens_norm={norm} is shorter than a {longest}-token response; "
            "set it to the generation's max_new_tokens or leave it unset"
        )
    total = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
    return total / max(mask.shape[0] * norm, 1)


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GRPOConfig,
    behaviour: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate (dual-clipped as ``cfg.dual_clip`` says) plus ``kl_coef`` times the
    ``kl_estimator`` per token, aggregated over the batch; with ``behaviour`` log-probs the
    surrogate is weighted by the rollout correction (``ppo_policy_loss``).

    ``advantages`` is ``[B]``, one per sequence, shared by its tokens. By default GRPO averages
    over all valid tokens of the batch (verl's and DAPO's "token-mean"): every token weighs the
    same, so a long response weighs more than a short one; ``loss_agg`` picks another mean.
    Dr. GRPO divides the token sum by ``B * max_new_tokens_norm``, a per-token weight that does
    not depend on any length. The ratio is clipped to ``cfg.clip_range()``.
    ``stats``: ``clip_frac``, ``dual_clip_frac``, ``kl`` (mean per valid token of the
    ``kl_estimator``), ``approx_kl`` (mean old - new); the ratio is bounded (``bounded_ratio``).
    """
    assert advantages.shape == logprobs.shape[:1], "advantages must be [B], one per sequence"
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = bounded_ratio(log_ratio)
    adv = advantages.to(ratio.dtype).unsqueeze(1)
    low, high = cfg.clip_range()
    surrogate, stats = clipped_surrogate(ratio, adv, mask, low, high, cfg.dual_clip)
    kl = kl_loss_term(logprobs, ref_logprobs, mask, cfg.kl_estimator)
    if behaviour is not None:
        weights, weight_stats = behaviour_weights(old_logprobs, behaviour, mask, cfg)
        surrogate = weights * surrogate
        stats.update(weight_stats)
    per_token = surrogate + cfg.kl_coef * kl
    loss = _aggregate(per_token, mask, cfg)
    with torch.no_grad():
        stats["kl"] = masked_mean(kl, mask).item()
        stats["approx_kl"] = masked_mean(-log_ratio, mask).item()
    return loss, stats


class GRPOActorInterface(LMInterface):
    """Generate ``group_size`` samples per prompt; GRPO / Dr. GRPO policy update."""

    name = "grpo_actor"
    config_type = GRPOConfig
    policy = True

    @property
    def cfg(self) -> GRPOConfig:
        return self.settings.algorithm

    @property
    def loss_config(self) -> GRPOConfig:
        """The settings ``grpo_loss`` runs with (RLOO's leave out the KL term)."""
        return self.cfg

    @property
    def loss_weight(self) -> Weight:
        """What the loss averages over, for the trainer's micro-batches."""
        return samples if self.cfg.dr_grpo else agg_weight(self.cfg.loss_agg)

    def policy_loss(
        self, logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor, mask: Tensor,
        behaviour: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
        """The update's loss and stats on one micro-batch (GSPO's is per sequence)."""
        cfg = self.loss_config
        if cfg.dr_grpo and cfg.max_new_tokens_norm is None:
            cfg = cfg.model_copy(update={"max_new_tokens_norm": self.longest_response})
        return grpo_loss(logp, old, ref, adv, mask, cfg, behaviour)

    @property
    def longest_response(self) -> int:
        """The most tokens a response may train: ``generation.max_new_tokens``, or a multi-turn
        trajectory's ``env.max_tokens`` (its turns together), Dr. GRPO's default divisor."""
        env = self.settings.env
        if env is not None and self.needs_env:
            return int(env.max_tokens)
        return self.settings.generation.max_new_tokens

    @classmethod
    def work_shape(cls, algorithm: GRPOConfig, kind: str) -> WorkShape:
        """``group_size`` samples per prompt; a train call's epochs and proximal share."""
        if kind == "generate":
            return WorkShape(samples_per_prompt=algorithm.group_size)
        if kind != "train":
            return WorkShape()
        return policy_train_shape(algorithm, algorithm.ppo_epochs, algorithm.n_minibatches)

    def generate(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        return sample_batch(engine, batch, self.generation(ctx), ctx, self.cfg.group_size)

    def advantages(self, engine: CallEngine, batch: PackedBatch, rank: int) -> torch.Tensor:
        """This rank's per-sample advantages, normalized over every rank's groups."""
        scores = batch.tensors["scores"].float()
        return over_groups(
            engine, batch, rank, scores, lambda x, g: grpo_advantages(x, g, self.cfg)
        )

    def add_advantages(self, engine: CallEngine, batch: PackedBatch, rank: int) -> None:
        """The batch's ``advantages`` key: one per sample (REINFORCE++'s: one per token)."""
        batch.add("advantages", self.advantages(engine, batch, rank), [1] * batch.n_samples)

    def minibatch_advantages(self, mb: PackedBatch) -> Tensor:
        return mb.tensors["advantages"]

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = rollout_stats(engine, batch)
        self.add_advantages(engine, batch, ctx.dp_rank)
        temperature = self.temperature
        reference = PolicyReference(
            engine, batch, temperature, self.cfg, self.cfg.ppo_epochs, ctx.step
        )

        def loss_fn(mb: PackedBatch):
            logp, _, mask = response_forward(engine, mb, temperature, self.cfg.router_replay)
            (old, behaviour), ref = reference.old(mb, logp, mask), padded(mb, "ref_logprobs")
            loss, s = self.policy_loss(
                logp, old, ref, self.minibatch_advantages(mb), mask, behaviour
            )
            return loss, {"policy_loss": loss.item(), **s}

        weight = self.loss_weight
        for epoch in range(self.cfg.ppo_epochs):
            minibatches = batch.split(self.cfg.n_minibatches, "seq")
            reference.start_epoch(epoch, minibatches)
            stats.update(engine.train(minibatches, loss_fn, weight))
        stats.update(reference.stats(engine))
        return stats


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(GRPOConfig, (GRPOActorInterface,))
