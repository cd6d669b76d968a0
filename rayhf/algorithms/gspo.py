"""GSPO, Group Sequence Policy Optimization (Zheng et al., 2025): ``GSPOConfig`` and
``gspo_actor``.

GRPO's sampling and group-normalized advantages, with the importance ratio and its clipping
taken per sequence instead of per token:

    s_i  = exp( mean over the response's tokens of (logprob_t - old_logprob_t) )
    loss = mean over sequences of max(-A_i * s_i, -A_i * clip(s_i, 1 - eps_low, 1 + eps_high))
           + kl_coef * (the kl_estimator's term, token-mean)

The sequence ratio is a length-normalized geometric mean, so every token of a sequence shares one
ratio and one clip decision; its gradient is s_i times the mean of the tokens' log-prob gradients.
The paper's clip range is tiny (3e-4 below, 4e-4 above), since a sequence ratio moves far less
than a token's. A rollout correction (and, with ``max_staleness`` > 0, decoupled PPO's weight)
is taken per sequence too: by default the geometric mean of the tokens' old / behaviour ratios,
truncated at ``weight_cap``.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.grpo import GRPOActorInterface, GRPOConfig, kl_loss_term
from rayhf.algorithms.interface import Algorithm
from rayhf.algorithms.offpolicy import behaviour_weights, bounded_ratio
from rayhf.algorithms.ppo import clipped_surrogate, masked_mean
from rayhf.engines.torch_trainer import Weight, samples


class GSPOConfig(GRPOConfig):
    """GSPO: GRPO's groups and advantages, a sequence-level ratio clipped in [1 - eps_low,
    1 + eps_high]."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["gspo"] = "gspo"  # type: ignore[assignment]
    """Selects this algorithm in the config's ``algorithm:`` section."""
    eps_low: float = Field(3e-4, gt=0, lt=1)
    """The sequence ratio is clipped below at ``1 - eps_low``."""
    eps_high: float = Field(4e-4, gt=0)
    """... and above at ``1 + eps_high``."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the per-token KL term, by ``kl_estimator`` (the paper uses none)."""
    loss_agg: Literal["seq_mean_token_mean"] = "seq_mean_token_mean"  # type: ignore[assignment]
    """GSPO's ratio is a sequence's: its loss is a mean over sequences."""
    correction_level: Literal["sequence", "geometric"] = "geometric"  # type: ignore[assignment]
    """A rollout correction's ``rho`` per sequence: the geometric mean of its tokens' (as its
    ratio), or their product."""
    dual_clip: None = None  # type: ignore[assignment]
    """GSPO clips a sequence's ratio once, in its tight range: no dual clip."""

    @model_validator(mode="after")
    def _no_token_options(self) -> GSPOConfig:
        if self.dr_grpo:
            raise ValueError("algorithm.dr_grpo: GSPO averages over sequences; set it false")
        return self


def sequence_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``[B]``: exp of the mean over each row's valid tokens of ``logprobs - old``; 1 for an
    empty row."""
    n = mask.sum(dim=1).clamp(min=1)
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    return bounded_ratio(log_ratio.sum(dim=1) / n)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GSPOConfig,
    behaviour: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO's clipped sequence surrogate (mean over non-empty sequences) plus ``kl_coef`` times
    the token-mean KL term (``kl_estimator``). ``stats``: ``clip_frac`` (share of sequences
    clipped; ``dual_clip_frac`` is 0: GSPO has none), ``kl``, ``approx_kl``,
    ``seq_ratio_mean``; with ``behaviour``, the correction's ``is_*`` stats."""
    assert advantages.shape == logprobs.shape[:1], "advantages must be [B], one per sequence"
    ratio = sequence_ratio(logprobs, old_logprobs, mask)
    adv = advantages.to(ratio.dtype)
    rows = mask.any(dim=1)
    per_seq, stats = clipped_surrogate(ratio, adv, rows, cfg.eps_low, cfg.eps_high, cfg.dual_clip)
    if behaviour is not None:  # one weight per sequence: its tokens all carry it
        weights, weight_stats = behaviour_weights(old_logprobs, behaviour, mask, cfg)
        if weights.shape[1]:  # a row's weight on each of its tokens (an empty row: 1)
            per_seq = weights[:, 0] * per_seq
        stats.update(weight_stats)
    surrogate = per_seq[rows].mean() if rows.any() else per_seq.sum() * 0.0
    kl = kl_loss_term(logprobs, ref_logprobs, mask, cfg.kl_estimator)
    loss = surrogate + cfg.kl_coef * masked_mean(kl, mask)
    with torch.no_grad():
        stats.update({
            "kl": masked_mean(kl, mask).item(),
            "approx_kl": masked_mean(old_logprobs - logprobs, mask).item(),
            "seq_ratio_mean": ratio[rows].mean().item() if rows.any() else 1.0,
        })  # fmt: skip
    return loss, stats


class GSPOActorInterface(GRPOActorInterface):
    """``group_size`` samples per prompt; GRPO's advantages, GSPO's sequence-level update."""

    name = "gspo_actor"
    config_type = GSPOConfig

    def policy_loss(
        self, logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor, mask: Tensor,
        behaviour: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
        cfg = self.cfg
        assert isinstance(cfg, GSPOConfig)
        return gspo_loss(logp, old, ref, adv, mask, cfg, behaviour)

    @property
    def loss_weight(self) -> Weight:
        return samples  # a mean over sequences


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(GSPOConfig, (GSPOActorInterface,))
