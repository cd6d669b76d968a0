"""REINFORCE++ and REINFORCE++-baseline (Hu, 2025; as OpenRLHF runs them): ``ReinforcePPConfig``
and ``reinforce_pp_actor``. No critic, and advantages normalized over the whole batch:

    REINFORCE++ (baseline: false)
      r_t   = score * [t is the last token] - kl_coef * (logprob_t - ref_logprob_t)
      G_t   = sum over s >= t of r_s                      (the return, undiscounted)
      A_t   = (G_t - mean) / std, over every valid token of every dp rank's batch (PPO's
              ``global_whiten``)
      loss  = PPO's clipped surrogate, token-mean; the KL is in the reward
    REINFORCE++-baseline (baseline: true)
      A     = (score - the mean score of its prompt's group), on each of its tokens,
              normalized over the batch's tokens as above
      loss  = the clipped surrogate + kl_coef * KL term (``kl_estimator``, k2 by default:
              ``(logprob - ref_logprob)**2 / 2``, OpenRLHF's, whose gradient is k1's in the reward)

The generator's log-probs make the KL of the reward. A multi-turn sample (``loss_mask``) is an
episode of its model tokens only: the returns run over them, the environment's tokens between
turns are no steps and get advantage 0. Asynchronous training (``max_staleness``) works as for
PPO and GRPO (decoupled PPO's per-token weights).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.grpo import (
    GRPOActorInterface,
    GRPOConfig,
    KLEstimator,
    group_advantages,
    kl_loss_term,
    over_groups,
)
from rayhf.algorithms.interface import Algorithm, CallEngine
from rayhf.algorithms.lm import padded
from rayhf.algorithms.ppo import (
    aggregate,
    compact,
    global_whiten,
    kl_shaped_rewards,
    masked_mean,
    ppo_policy_loss,
    spread,
)
from rayhf.algorithms.seqs import pack_per_token, response_index
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError


class ReinforcePPConfig(GRPOConfig):
    """REINFORCE++: a KL-shaped return per token (or, with ``baseline``, the score against its
    group's mean), normalized over the batch; PPO's clipped update; no critic."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["reinforce_pp"] = "reinforce_pp"  # type: ignore[assignment]
    """Selects this algorithm in the config's ``algorithm:`` section."""
    baseline: bool = False
    """REINFORCE++-baseline: subtract the group's mean score (needs group_size > 1), the KL as
    a loss term (``kl_estimator``) instead of in the reward."""
    group_size: int = Field(1, gt=0)
    """Samples per prompt (REINFORCE++ needs one; its baseline variant compares a group)."""
    kl_coef: float = Field(0.01, ge=0)
    """The KL's weight: in each token's reward, or (baseline) in the loss."""
    kl_estimator: KLEstimator = "k2"
    """With ``baseline``, the loss's KL term (``kl_loss_term``): ``k2`` (OpenRLHF's; its gradient
    is that of k1 in the reward), ``k3`` (GRPO's) or ``k1``; without, the reward's KL is k1."""

    @model_validator(mode="after")
    def _groups_for_a_baseline(self) -> ReinforcePPConfig:
        if self.baseline and self.group_size < 2:
            raise ValueError("algorithm.baseline: true compares a group; set group_size >= 2")
        if self.dr_grpo:
            raise ValueError("algorithm.dr_grpo: REINFORCE++ averages over tokens; set it false")
        return self


def token_returns(rewards: Tensor, mask: Tensor) -> Tensor:
    """``G_t = sum_{s >= t} r_s`` along each row's valid tokens ``[B, T]``; 0 on padding."""
    r = torch.where(mask, rewards, torch.zeros_like(rewards))
    return torch.where(mask, r.flip(1).cumsum(1).flip(1), torch.zeros_like(r))


def reinforce_pp_advantages(
    scores: Tensor, logprobs: Tensor, ref: Tensor, mask: Tensor, kl_coef: float
) -> Tensor:
    """REINFORCE++'s returns ``[B, T]`` before the batch normalization (a right-padded mask)."""
    rewards, _ = kl_shaped_rewards(scores, logprobs, ref, mask, kl_coef, float("inf"))
    return token_returns(rewards, mask)


def trained_returns(batch: PackedBatch, mask: Tensor, kl_coef: float) -> Tensor:
    """``reinforce_pp_advantages`` over the tokens ``mask`` keeps (a multi-turn sample's model
    tokens, moved together), ``[B, R]`` with 0 on the others."""
    keys = ("logprobs", "ref_logprobs")
    (logp, ref), kept, order = compact([padded(batch, k) for k in keys], mask)
    scores = batch.tensors["scores"].float()
    return spread(reinforce_pp_advantages(scores, logp, ref, kept, kl_coef), order, mask.shape)


class ReinforcePPActorInterface(GRPOActorInterface):
    """``group_size`` samples per prompt; REINFORCE++'s token advantages, PPO's update."""

    name = "reinforce_pp_actor"
    config_type = ReinforcePPConfig

    def add_advantages(self, engine: CallEngine, batch: PackedBatch, rank: int) -> None:
        cfg = cast(ReinforcePPConfig, self.cfg)
        _, mask = response_index(batch)
        if cfg.baseline:
            returns = self._group_centred(engine, batch, rank, mask)
        else:
            returns = trained_returns(batch, mask, cfg.kl_coef)
        adv = global_whiten(engine, returns, mask)
        batch.add("advantages", *pack_per_token(batch, adv))

    def _group_centred(
        self, engine: CallEngine, batch: PackedBatch, rank: int, mask: Tensor
    ) -> Tensor:
        """Each sample's score minus its group's mean, on each token ``mask`` keeps."""
        if "group_ids" not in batch.tensors:
            raise RayhfError(
                "algorithm.baseline: true compares each prompt's group: use "
                "graph: graphs/reinforce_pp_baseline.yaml and group_size > 1"
            )
        scores = batch.tensors["scores"].float()
        own = over_groups(
            engine, batch, rank, scores, lambda x, g: group_advantages(x, g, 0.0, False)
        )
        return torch.where(mask, own.unsqueeze(1).expand_as(mask), 0.0)

    def minibatch_advantages(self, mb: PackedBatch) -> Tensor:
        return padded(mb, "advantages")

    def policy_loss(
        self, logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor, mask: Tensor,
        behaviour: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
        cfg = cast(ReinforcePPConfig, self.cfg)
        loss, stats = ppo_policy_loss(
            logp, old, adv, mask, cfg.eps_clip, behaviour, cfg, cfg.loss_agg
        )
        kl = kl_loss_term(logp, ref, mask, cfg.kl_estimator)
        if cfg.baseline:
            loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.loss_agg)
        return loss, {**stats, "kl": masked_mean(kl, mask).item()}


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(ReinforcePPConfig, (ReinforcePPActorInterface,))
