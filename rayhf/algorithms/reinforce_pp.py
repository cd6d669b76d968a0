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
      loss  = the clipped surrogate + kl_coef * GRPO's k3 term

The generator's log-probs make the KL of the reward. Asynchronous training (``max_staleness``)
works as for PPO and GRPO (decoupled PPO's per-token weights).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.grpo import (
    GRPOActorInterface,
    GRPOConfig,
    group_advantages,
    k3_kl,
    over_groups,
)
from rayhf.algorithms.interface import ModelEngine, register
from rayhf.algorithms.lm import padded
from rayhf.algorithms.ppo import (
    aggregate,
    global_whiten,
    kl_shaped_rewards,
    masked_mean,
    ppo_policy_loss,
)
from rayhf.algorithms.seqs import response_index
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
    GRPO's k3 term in the loss instead of in the reward."""
    group_size: int = Field(1, gt=0)
    """Samples per prompt (REINFORCE++ needs one; its baseline variant compares a group)."""
    kl_coef: float = Field(0.01, ge=0)
    """The KL's weight: in each token's reward, or (baseline) in the loss."""

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
    """REINFORCE++'s returns ``[B, T]`` before the batch normalization."""
    rewards, _ = kl_shaped_rewards(scores, logprobs, ref, mask, kl_coef, float("inf"))
    return token_returns(rewards, mask)


@register("reinforce_pp_actor")
class ReinforcePPActorInterface(GRPOActorInterface):
    """``group_size`` samples per prompt; REINFORCE++'s token advantages, PPO's update."""

    config_type = ReinforcePPConfig

    def add_advantages(self, engine: ModelEngine, batch: PackedBatch, rank: int) -> None:
        cfg = cast(ReinforcePPConfig, self.cfg)
        _, mask = response_index(batch)
        scores = batch.tensors["scores"].float()
        if cfg.baseline:
            if "group_ids" not in batch.tensors:
                raise RayhfError(
                    "algorithm.baseline: true compares each prompt's group: use "
                    "graph: graphs/reinforce_pp_baseline.yaml and group_size > 1"
                )
            own = over_groups(
                engine, batch, rank, scores, lambda x, g: group_advantages(x, g, 0.0, False)
            )
            returns = torch.where(mask, own.unsqueeze(1).expand_as(mask), 0.0)
        else:
            logp, ref = padded(batch, "logprobs"), padded(batch, "ref_logprobs")
            returns = reinforce_pp_advantages(scores, logp, ref, mask, cfg.kl_coef)
        adv = global_whiten(engine, returns, mask)
        batch.add("advantages", adv[mask], mask.sum(1).tolist())

    def minibatch_advantages(self, mb: PackedBatch) -> Tensor:
        return padded(mb, "advantages")

    def policy_loss(
        self, logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor, mask: Tensor,
        behaviour: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
        cfg = cast(ReinforcePPConfig, self.cfg)
        loss, stats = ppo_policy_loss(
            logp, old, adv, mask, cfg.eps_clip, behaviour, cfg.weight_cap, cfg.loss_agg
        )  # fmt: skip
        kl = k3_kl(logp, ref, mask)
        if cfg.baseline:
            loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.loss_agg)
        return loss, {**stats, "kl": masked_mean(kl, mask).item()}
