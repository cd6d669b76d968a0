"""Training on samples from an older policy: ``algorithm.max_staleness`` and decoupled PPO.

With ``max_staleness: k`` the generate call of step i may sample with the policy of any update
from step i-k-1 on (``rayhf.planner.step.pipeline`` runs it ahead), so the samples come from a
*behaviour* policy older than the one being trained. Decoupled PPO (Hilton et al., 2022)
separates the two roles the old policy plays in PPO:

    behaviour log-probs (the generate call's, from the weights that sampled)
    proximal log-probs  (recomputed by the train call before its first update)
    weight w = min(pi_prox / pi_behaviour, weight_cap)      per token, no gradient
    loss     = w * max(-A * r, -A * clip(r, 1 - eps, 1 + eps)),   r = pi_theta / pi_prox

That truncated weight is the default (``correction: auto``); AReaL instead masks a token whose
weight is above the cap (``correction: mis``). The same weight, by ``correction``, is rollout
correction on-policy (``behaviour_weights``): there the old log-probs are the trainer's own,
recomputed before its first update (``old_logprobs: recompute``), and the behaviour ones the
generator's.

so the trust region is around the proximal policy and the importance weight corrects for the
samples' origin. When the versions match, pi_prox = pi_behaviour and w = 1: the standard loss.

The proximal log-probs are the trainer's before its first update. The first minibatch's own
forward in the first epoch runs before any update, so with one epoch (the default) it gives that
minibatch's proximal log-probs for free: only the other minibatches need a forward of their own
(before the first update), which saves 1 / ``n_minibatches`` of that pass.

With ``proximal: interpolate`` (AReaL's log-linear approximation, counted here in updates
rather than steps) no forward runs for them: each generated sample carries the version of the
weights that sampled it (``VERSION_EXTRA``), and a minibatch that ``u`` updates of this call
precede, from samples ``s`` steps stale (``U`` updates a step), takes

    log pi_prox ~ log pi_behaviour + a * (log pi_theta - log pi_behaviour),  a = sU / (sU + u)

which is exact where it can be: before the first update (u = 0: pi_theta is pi_prox) and for
samples of the proximal weights themselves (s = 0).

The log-prob mismatch between the generator and the trainer (mean |behaviour - proximal| per
token) is reported on every step: at staleness 0 it is the check that the generation engine
and the trainer compute the same policy. There it costs nothing: it is read from the first
minibatch's forward.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.interface import VERSION_EXTRA, CallEngine, WorkShape
from rayhf.algorithms.lm import logprob_batch, padded
from rayhf.algorithms.seqs import response_index
from rayhf.data.batch import PackedBatch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


class OffPolicyConfig(BaseModel):
    """Fields of an algorithm that trains on samples of an older policy (PPO, GRPO)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    max_staleness: int = Field(0, ge=0)
    """Updates the sampling policy may lag the trained one: 0 is on-policy; k >= 1 lets the
    generation of step i run while step i-1 trains (weights from step i-k-1's update on)."""
    old_logprobs: Literal["generator", "recompute"] | None = None
    """On-policy, what the ratio is taken against: the generator's log-probs (``generator``,
    verl's bypass mode: a generator/trainer mismatch is clipped as if it were a policy change)
    or the trainer's own before its first update (``recompute``: a forward of the batch but
    its first minibatch, the mismatch then left to ``correction``). None: ``recompute`` when a
    ``correction`` is set, else ``generator``. Off-policy it is always the proximal policy's."""
    correction: Literal["auto", "none", "tis", "mis", "icepop"] = "auto"
    """Rollout correction, the weight of each token's loss by ``rho = pi_old / pi_behaviour``
    (the trainer's over the generator's): ``tis`` truncates it at ``weight_cap``, ``mis`` masks
    it (0) outside ``[weight_floor, weight_cap]`` and keeps it inside, ``icepop`` is ``mis`` per
    token within ``[0.5, 5]`` unless those are set; ``auto``: ``tis`` with ``max_staleness`` >
    0 (decoupled PPO), else ``none``."""
    correction_level: Literal["token", "sequence", "geometric"] = "token"
    """What ``rho`` is: each token's, its sequence's product (broadcast to its tokens) or the
    geometric mean of its sequence's (both bounded to ``exp(+-20)``)."""
    weight_cap: float | None = Field(None, gt=0)
    """Upper bound of ``rho``: where ``tis`` truncates it, above which ``mis`` and ``icepop``
    mask it (None: 2; ``icepop``: 5)."""
    weight_floor: float | None = Field(None, ge=0)
    """Lower bound of ``rho`` under which ``mis`` and ``icepop`` mask it (None: ``1 /
    weight_cap``; ``icepop``: 0.5)."""
    dual_clip: float | None = Field(3.0, gt=1)
    """Dual-clip PPO (Ye et al., 2020; verl's default ``c = 3``): a token with a negative
    advantage loses at most ``-c * A``, however far its ratio went; None turns it off."""
    proximal: Literal["recompute", "interpolate"] = "recompute"
    """How a train call gets the proximal log-probs when ``max_staleness`` > 0: ``recompute``
    forwards its batch before the first update (exact); ``interpolate`` skips that forward and
    places them between the behaviour log-probs and each minibatch's own (AReaL's log-linear
    approximation)."""
    router_replay: Literal["off", "measure", "replay"] = "off"
    """A Mixture-of-Experts policy's routing in its own forwards: ``replay`` sends each token
    to the experts the generator chose for it (R3, rollout routing replay; the router's
    weights of them still learn); ``measure`` keeps the router's choice. Both keep the
    generator's choice with each sample (the native engine's) and report, over a train
    call's first minibatch (before its first update), the share of (token, MoE layer) pairs
    whose router chose another expert set than the generator (``routes_differ_own``) and
    that went to another set (``routes_differ``: 0 when replayed)."""
    loss_agg: LossAgg = "token_mean"
    """How the policy loss is averaged: over every response token of the batch
    (``token_mean``, DAPO's token-level loss), or per response first (``seq_mean_token_mean``,
    the GRPO paper's; ``seq_mean_token_sum``), then over responses."""

    @model_validator(mode="after")
    def _correction_needs_old_logprobs(self) -> OffPolicyConfig:
        if self.max_staleness > 0 and self.old_logprobs is not None:
            raise ValueError(
                "algorithm.old_logprobs: with max_staleness > 0 the ratio is always taken "
                "against the proximal policy; leave old_logprobs unset"
            )
        if self.old_logprobs == "generator" and self.corrects:
            raise ValueError(
                f"algorithm.correction {self.correction} weighs the trainer's old log-probs "
                "against the generator's: set algorithm.old_logprobs: recompute (or leave it "
                "unset)"
            )
        floor, cap = self.correction_bounds()
        if self.correction in ("mis", "icepop") and floor >= cap:
            raise ValueError(
                f"algorithm.weight_floor {floor:g} is not below weight_cap {cap:g}: every token "
                "would be masked; lower weight_floor"
            )
        return self

    @property
    def corrects(self) -> bool:
        """Whether a rollout correction weighs the loss."""
        if self.correction == "auto":
            return self.max_staleness > 0
        return self.correction != "none"

    @property
    def recomputes(self) -> bool:
        """Whether the ratio is taken against the trainer's own old log-probs (recomputed or,
        off-policy, interpolated) rather than the generator's."""
        if self.max_staleness > 0:
            return True
        return self.old_logprobs == "recompute" or (self.old_logprobs is None and self.corrects)

    def correction_bounds(self) -> tuple[float, float]:
        """``(floor, cap)`` of ``rho`` as the ``correction`` reads them."""
        icepop = self.correction == "icepop"
        cap = self.weight_cap if self.weight_cap is not None else 5.0 if icepop else 2.0
        floor = self.weight_floor
        if floor is None:
            floor = 0.5 if icepop else 1.0 / cap
        return floor, cap


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


# exp(20) ~ 5e8: finite in fp32 (log-probs and losses are fp32), far past any clip bound, so the
# clipped loss is the same wherever a ratio means anything; an unbounded log-ratio of ~89 gives
# an infinite ratio and NaN gradients even where the clip picks the other side (verl: +-20)
LOG_RATIO_LIMIT = 20.0


def bounded_ratio(log_ratio: Tensor) -> Tensor:
    """``exp(log_ratio)`` with the log-ratio clamped to ``+-LOG_RATIO_LIMIT``."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    total = torch.where(mask, x, torch.zeros_like(x)).sum()
    return total / mask.sum().clamp(min=1).to(total.dtype)


def rollout_ratio(proximal: Tensor, behaviour: Tensor, mask: Tensor, level: str) -> Tensor:
    """``rho = pi_old / pi_behaviour`` per token ``[B, T]``: each token's, or its sequence's
    product or geometric mean on each of its tokens; bounded, 1 on padding."""
    log_ratio = torch.where(mask, proximal - behaviour, torch.zeros_like(proximal))
    if level != "token":
        rows = log_ratio.sum(dim=1, keepdim=True)
        if level == "geometric":
            rows = rows / mask.sum(dim=1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(mask, rows.expand_as(log_ratio), torch.zeros_like(log_ratio))
    return bounded_ratio(log_ratio)


def behaviour_weights(
    proximal: Tensor, behaviour: Tensor, mask: Tensor, cfg: OffPolicyConfig
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights of the loss by the rollout correction ``cfg`` asks for (1 where none,
    and on padding; no gradient), and their stats: ``is_weight_mean``, ``is_weight_std``,
    ``is_weight_max`` of ``rho`` before any bound, ``is_capped_frac`` (tokens above the cap) and
    ``is_masked_frac`` (tokens a mask drops). A masked token weighs 0 and still counts in its
    mean, as in IcePop's objective (verl drops it from the denominator)."""
    raw = rollout_ratio(proximal, behaviour, mask, cfg.correction_level)
    floor, cap = cfg.correction_bounds()
    mode = ("tis" if cfg.max_staleness else "none") if cfg.correction == "auto" else cfg.correction
    dropped = torch.zeros_like(mask)
    if mode == "none":
        weights = torch.ones_like(raw)
    elif mode == "tis":
        weights = raw.clamp(max=cap)
    else:
        dropped = mask & ((raw > cap) | (raw < floor))
        weights = torch.where(dropped, torch.zeros_like(raw), raw)
    valid = raw[mask]
    stats = {
        "is_weight_mean": _masked_mean(raw, mask).item(),
        "is_weight_std": valid.std().item() if valid.numel() > 1 else 0.0,
        "is_weight_max": valid.max().item() if valid.numel() else 1.0,
        "is_capped_frac": _masked_mean((raw > cap).float(), mask).item(),
        "is_masked_frac": _masked_mean(dropped.float(), mask).item(),
    }
    return torch.where(mask, weights, torch.ones_like(weights)).detach(), stats


def policy_train_shape(cfg: OffPolicyConfig, epochs: int, n_minibatches: int) -> WorkShape:
    """A policy train call's work as ``PolicyReference`` runs it: ``epochs`` passes, and the
    share of the batch it forwards for the proximal log-probs (none on-policy or interpolated,
    all but the first minibatch with one epoch, all with more)."""
    if not cfg.recomputes or (cfg.max_staleness and cfg.proximal == "interpolate"):
        share = 0.0
    else:
        share = 1.0 if epochs > 1 else (n_minibatches - 1) / n_minibatches
    return WorkShape(epochs=epochs, forward_share=share)


class PolicyReference:
    """What one train call's policy loss compares its log-probs with: the behaviour log-probs
    (``logprobs``, from the generate call) on-policy; with ``max_staleness`` > 0 the proximal
    ones (the trainer's before its first update, recomputed or interpolated) with the behaviour
    weights. It also sums the generator/trainer log-prob mismatch. ``epochs``: how many times
    the call goes over its minibatches (with more than one every recomputed proximal log-prob
    is computed up front); ``step``: the call's step (its proximal weights are step - 1's)."""

    def __init__(
        self,
        engine: CallEngine,
        batch: PackedBatch,
        temperature: float,
        cfg: OffPolicyConfig,
        epochs: int,
        step: int = 0,
    ) -> None:
        self.engine, self.temperature = engine, temperature
        self.routes = cfg.router_replay
        self.decoupled = cfg.recomputes
        self.interpolate = cfg.max_staleness > 0 and cfg.proximal == "interpolate"
        self.first_free = epochs == 1  # the first minibatch's forward gives its proximal ones
        self.first: set[int] = set()  # the minibatch whose forward precedes every update
        self.epoch, self.epochs = 0, epochs
        self.sums = torch.zeros(2, dtype=torch.float64)  # sum |behaviour - proximal|, tokens
        self.lags: dict[int, int] = {}  # sample id -> steps its weights lag the proximal ones
        self.updates_before: dict[int, int] = {}  # sample id -> updates of this call before it
        self.updates = 0  # updates this call makes in all
        if self.interpolate:
            self.lags = _lags(batch, step)
        elif self.decoupled and not self.first_free:
            self._proximal(batch)

    def start_epoch(self, epoch: int, minibatches: list[PackedBatch]) -> None:
        """Before ``engine.train`` goes over ``minibatches`` (one update each): with one epoch,
        the recomputed proximal log-probs of every minibatch after the first (no update has
        run yet)."""
        self.epoch, self.updates = epoch, len(minibatches) * self.epochs
        for j, mb in enumerate(minibatches):
            self.updates_before.update(dict.fromkeys(mb.sample_ids, epoch * len(minibatches) + j))
        if epoch == 0 and minibatches:
            self.first = set(minibatches[0].sample_ids)
            rest = [mb for mb in minibatches[1:] if mb.n_samples]
            if self.decoupled and self.first_free and not self.interpolate and rest:
                got = self._proximal(PackedBatch.concat(rest))
                for mb in rest:
                    mb.update(got.reorder(mb.sample_ids))

    def _proximal(self, batch: PackedBatch) -> PackedBatch:
        """``prox_logprobs`` of ``batch`` by a forward of the current weights (kept in it too),
        summed into the mismatch."""
        got = logprob_batch(self.engine, batch, self.temperature, "prox_logprobs", self.routes)
        batch.update(got)
        _, mask = response_index(batch)
        self._add(padded(batch, "logprobs"), padded(batch, "prox_logprobs"), mask)
        return got

    def _interpolated(self, mb: PackedBatch, current: Tensor, behaviour: Tensor) -> Tensor:
        """``mb``'s proximal log-probs between ``behaviour`` and ``current`` (the weights after
        ``u`` of this call's updates): weight ``sU / (sU + u)`` on ``current`` for samples
        ``s`` steps stale, ``U`` updates a step; exact at u = 0 and at s = 0."""
        lag = torch.tensor([self.lags[i] for i in mb.sample_ids], dtype=current.dtype)
        done = torch.tensor([self.updates_before[i] for i in mb.sample_ids], dtype=lag.dtype)
        span = lag * self.updates
        alpha = torch.where(done > 0, span / (span + done).clamp(min=1), torch.ones_like(lag))
        return behaviour + alpha[:, None] * (current - behaviour)

    def old(self, mb: PackedBatch, logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(log-probs the ratio is taken against, behaviour log-probs or None)`` for ``mb``,
        whose current log-probs are ``logprobs``. Those of the first minibatch in the first
        epoch are the trainer's before any update: the proximal ones (with one epoch, or
        interpolated) and the mismatch's other side (on-policy)."""
        behaviour = padded(mb, "logprobs")
        before_any_update = self.epoch == 0 and set(mb.sample_ids) <= self.first
        if not self.decoupled:
            if before_any_update:
                self._add(behaviour, logprobs.detach(), mask)
            return behaviour, None
        if self.interpolate:
            proximal = self._interpolated(mb, logprobs.detach(), behaviour)
        elif before_any_update and self.first_free:
            proximal = logprobs.detach()
        else:
            return padded(mb, "prox_logprobs"), behaviour
        proximal = torch.where(mask, proximal, torch.zeros_like(proximal))
        if before_any_update:
            self._add(behaviour, proximal, mask)
        return proximal, behaviour

    def _add(self, behaviour: Tensor, proximal: Tensor, mask: Tensor) -> None:
        diff = torch.where(mask, (behaviour - proximal).abs(), torch.zeros_like(behaviour))
        self.sums += torch.stack([diff.double().sum(), mask.sum().double()])

    def stats(self, engine: CallEngine) -> dict[str, float]:
        """``logprob_mismatch``: mean |behaviour - proximal| per token over every dp rank."""
        total = engine.all_reduce_sum(self.sums)
        return {"logprob_mismatch": float(total[0] / total[1].clamp(min=1))}


def _lags(batch: PackedBatch, step: int) -> dict[int, int]:
    """Sample id -> how many steps its sampling weights lag step ``step``'s proximal ones."""
    if VERSION_EXTRA not in batch.extras:
        raise RuntimeError(
            f"algorithm.proximal: interpolate needs each sample's '{VERSION_EXTRA}', which the "
            "generate call adds; this batch has none"
        )
    versions = batch.extras[VERSION_EXTRA]
    return {i: step - 1 - int(v) for i, v in zip(batch.sample_ids, versions, strict=True)}
