"""RLOO, REINFORCE with a leave-one-out baseline (Ahmadian et al., "Back to Basics", 2024; as
TRL and OpenRLHF run it): ``RLOOConfig`` and ``rloo_actor``.

Each prompt is sampled ``group_size`` (k) times, as in GRPO. The KL to the reference is taken out
of each sample's reward, not added to the loss, and each sample is compared with the mean of the
*other* samples of its prompt, with no division by a std:

    reward_i    = score_i - kl_coef * sum_t (logprob_t - ref_logprob_t)   (the generator's)
    advantage_i = reward_i - (sum_j reward_j - reward_i) / (k - 1)
                = k / (k - 1) * (reward_i - mean_j reward_j)

The update is GRPO's clipped surrogate, token-mean, without its k3 term (``grpo_loss`` at
``kl_coef`` 0); asynchronous training (``max_staleness``) works as it does for GRPO.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.grpo import GRPOActorInterface, GRPOConfig, over_groups
from rayhf.algorithms.interface import ModelEngine, register
from rayhf.algorithms.lm import padded
from rayhf.algorithms.seqs import response_index
from rayhf.data.batch import PackedBatch


class RLOOConfig(GRPOConfig):
    """RLOO: GRPO's sampling and update, the KL in the reward and a leave-one-out baseline."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["rloo"] = "rloo"  # type: ignore[assignment]
    """Selects this algorithm in the config's ``algorithm:`` section."""
    kl_coef: float = Field(0.05, ge=0)
    """Weight of the sample's KL to the reference (its summed log-ratio), taken from its reward."""


def loo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Each reward minus the mean of the other rewards of its group; 0 in a group of one."""
    assert rewards.dim() == 1 and rewards.shape == group_ids.shape, "need rewards, group_ids [N]"
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = rewards.new_zeros(n_groups).index_add_(0, group, torch.ones_like(rewards))
    total = rewards.new_zeros(n_groups).index_add_(0, group, rewards)
    others = (total[group] - rewards) / (count[group] - 1).clamp(min=1)
    return torch.where(count[group] < 2, torch.zeros_like(rewards), rewards - others)


def kl_rewards(scores: Tensor, logprobs: Tensor, ref: Tensor, mask: Tensor, coef: float) -> Tensor:
    """``scores - coef * sum_t (logprobs - ref)`` over each sample's response tokens ``[B, T]``."""
    log_ratio = torch.where(mask, logprobs - ref, torch.zeros_like(logprobs))
    return scores - coef * log_ratio.sum(dim=1)


@register("rloo_actor")
class RLOOActorInterface(GRPOActorInterface):
    """``group_size`` samples per prompt; RLOO's advantages, GRPO's clipped update."""

    config_type = RLOOConfig

    @property
    def loss_config(self) -> GRPOConfig:
        return self.cfg.model_copy(update={"kl_coef": 0.0})  # the KL is in the reward

    def advantages(self, engine: ModelEngine, batch: PackedBatch, rank: int) -> Tensor:
        """This rank's leave-one-out advantages of KL-penalized rewards, over every rank's
        groups."""
        _, mask = response_index(batch)
        logp, ref = padded(batch, "logprobs"), padded(batch, "ref_logprobs")
        rewards = kl_rewards(batch.tensors["scores"].float(), logp, ref, mask, self.cfg.kl_coef)
        return over_groups(engine, batch, rank, rewards, loo_advantages)
