"""Training on samples from an older policy: ``algorithm.max_staleness`` and decoupled PPO.

With ``max_staleness: k`` the generate call of step i may sample with the policy of any update
from step i-k-1 on (``rayhf.planner.step.pipeline`` runs it ahead), so the samples come from a
*behaviour* policy older than the one being trained. Decoupled PPO (Hilton et al., 2022, as
AReaL uses it) separates the two roles the old policy plays in PPO:

    behaviour log-probs (the generate call's, from the weights that sampled)
    proximal log-probs  (recomputed by the train call before its first update)
    weight w = min(pi_prox / pi_behaviour, weight_cap)      per token, no gradient
    loss     = w * max(-A * r, -A * clip(r, 1 - eps, 1 + eps)),   r = pi_theta / pi_prox

so the trust region is around the proximal policy and the importance weight corrects for the
samples' origin. When the versions match, pi_prox = pi_behaviour and w = 1: the standard loss.

The proximal log-probs are the trainer's before its first update. The first minibatch's own
forward in the first epoch runs before any update, so with one epoch (the default) it gives that
minibatch's proximal log-probs for free: only the other minibatches need a forward of their own
(before the first update), which saves 1 / ``n_minibatches`` of that pass.

The log-prob mismatch between the generator and the trainer (mean |behaviour - proximal| per
token) is reported on every step: at staleness 0 it is the check that the generation engine
and the trainer compute the same policy. There it costs nothing: it is read from the first
minibatch's forward.
"""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.interface import ModelEngine, WorkShape
from rayhf.algorithms.lm import logprob_batch, padded
from rayhf.algorithms.seqs import response_index
from rayhf.data.batch import PackedBatch


class OffPolicyConfig(BaseModel):
    """Fields of an algorithm that trains on samples of an older policy (PPO, GRPO)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_staleness: int = Field(0, ge=0)
    """Updates the sampling policy may lag the trained one: 0 is on-policy; k >= 1 lets the
    generation of step i run while step i-1 trains (weights from step i-k-1's update on)."""
    weight_cap: float = Field(2.0, gt=0)
    """Cap of the per-token importance weight pi_prox / pi_behaviour (truncated importance
    sampling) when ``max_staleness`` > 0."""


class OnPolicyConfig(BaseModel):
    """``max_staleness`` for an algorithm with no off-policy correction: 0 only."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_staleness: int = Field(0, ge=0)
    """Must be 0: this algorithm has no off-policy correction."""

    @model_validator(mode="after")
    def _on_policy_only(self) -> OnPolicyConfig:
        if self.max_staleness:
            name = getattr(self, "name", "this algorithm")
            raise ValueError(
                f"max_staleness {self.max_staleness}: {name} has no off-policy correction; "
                "set algorithm.max_staleness: 0 or use ppo or grpo"
            )
        return self


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1).to(total.dtype)


def behaviour_weights(
    proximal: Tensor, behaviour: Tensor, mask: Tensor, cap: float
) -> tuple[Tensor, dict[str, float]]:
    """Per-token ``min(exp(proximal - behaviour), cap)`` (1 on padding), and its stats:
    ``is_weight_mean``, ``is_weight_max`` (before the cap) and ``is_capped_frac``."""
    raw = torch.exp(torch.where(mask, proximal - behaviour, torch.zeros_like(proximal)))
    stats = {
        "is_weight_mean": _masked_mean(raw, mask).item(),
        "is_weight_max": raw[mask].max().item() if mask.any() else 1.0,
        "is_capped_frac": _masked_mean((raw > cap).float(), mask).item(),
    }
    return raw.clamp(max=cap), stats


def policy_train_shape(cfg: OffPolicyConfig, epochs: int, n_minibatches: int) -> WorkShape:
    """A policy train call's work as ``PolicyReference`` runs it: ``epochs`` passes, and the
    share of the batch it forwards for the proximal log-probs (none on-policy, all but the first
    minibatch with one epoch, all with more)."""
    if not cfg.max_staleness:
        share = 0.0
    else:
        share = 1.0 if epochs > 1 else (n_minibatches - 1) / n_minibatches
    return WorkShape(epochs=epochs, forward_share=share)


class PolicyReference:
    """What one train call's policy loss compares its log-probs with: the behaviour log-probs
    (``logprobs``, from the generate call) on-policy; with ``max_staleness`` > 0 the proximal
    ones (the trainer's before its first update) with the behaviour weights. It also sums the
    generator/trainer log-prob mismatch. ``epochs``: how many times the call goes over its
    minibatches (with more than one every proximal log-prob is computed up front)."""

    def __init__(
        self,
        engine: ModelEngine,
        batch: PackedBatch,
        temperature: float,
        cfg: OffPolicyConfig,
        epochs: int,
    ) -> None:
        self.engine, self.temperature = engine, temperature
        self.decoupled = cfg.max_staleness > 0
        self.first_free = epochs == 1  # the first minibatch's forward gives its proximal ones
        self.first: set[int] = set()  # the minibatch whose forward precedes every update
        self.epoch = 0
        self.sums = torch.zeros(2, dtype=torch.float64)  # sum |behaviour - proximal|, tokens
        if self.decoupled and not self.first_free:
            self._proximal(batch)

    def start_epoch(self, epoch: int, minibatches: list[PackedBatch]) -> None:
        """Before ``engine.train`` goes over ``minibatches``: with one epoch, the proximal
        log-probs of every minibatch after the first (no update has run yet)."""
        self.epoch = epoch
        if epoch == 0 and minibatches:
            self.first = set(minibatches[0].sample_ids)
            rest = [mb for mb in minibatches[1:] if mb.n_samples]
            if self.decoupled and self.first_free and rest:
                got = self._proximal(PackedBatch.concat(rest))
                for mb in rest:
                    mb.update(got.reorder(mb.sample_ids))

    def _proximal(self, batch: PackedBatch) -> PackedBatch:
        """``prox_logprobs`` of ``batch`` by a forward of the current weights (kept in it too),
        summed into the mismatch."""
        got = logprob_batch(self.engine, batch, self.temperature, key="prox_logprobs")
        batch.update(got)
        _, mask = response_index(batch)
        self._add(padded(batch, "logprobs"), padded(batch, "prox_logprobs"), mask)
        return got

    def old(self, mb: PackedBatch, logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(log-probs the ratio is taken against, behaviour log-probs or None)`` for ``mb``,
        whose current log-probs are ``logprobs``. Those of the first minibatch in the first
        epoch are the trainer's before any update: the proximal ones (with one epoch) and the
        mismatch's other side (on-policy)."""
        behaviour = padded(mb, "logprobs")
        before_any_update = self.epoch == 0 and set(mb.sample_ids) <= self.first
        if not self.decoupled:
            if before_any_update:
                self._add(behaviour, logprobs.detach(), mask)
            return behaviour, None
        if before_any_update and self.first_free:
            proximal = torch.where(mask, logprobs.detach(), torch.zeros_like(logprobs))
            self._add(behaviour, proximal, mask)
            return proximal, behaviour
        return padded(mb, "prox_logprobs"), behaviour

    def _add(self, behaviour: Tensor, proximal: Tensor, mask: Tensor) -> None:
        diff = torch.where(mask, (behaviour - proximal).abs(), torch.zeros_like(behaviour))
        self.sums += torch.stack([diff.double().sum(), mask.sum().double()])

    def stats(self, engine: ModelEngine) -> dict[str, float]:
        """``logprob_mismatch``: mean |behaviour - proximal| per token over every dp rank."""
        total = engine.all_reduce_sum(self.sums)
        return {"logprob_mismatch": float(total[0] / total[1].clamp(min=1))}
