"""ReMax: ``ReMaxConfig``, the loss as pure torch functions, and the ``remax_actor`` interface.

ReMax is REINFORCE with the greedy response's score as the baseline. Per prompt, one sampled and
one greedy response are scored; the greedy score removes the prompt's difficulty from the sampled
one, so no critic is needed (Li et al., 2023):

    sampled, greedy scores, logprobs, ref logprobs --remax_advantages--> return-to-go [B, T]
    logprobs, advantages                           --reinforce_loss----> loss

Tensor conventions are those of ``rayhf.algorithms.ppo``: right-padded ``[B, T]`` response tokens
with a bool ``mask``; empty rows contribute nothing and never produce NaN. ReMax's graph generates
twice (sampled, and greedy through call args) and scores both; the ``remax_actor`` train call
takes a REINFORCE step with ``r(sampled) - r(greedy)`` as the baseline-corrected return, over a
multi-turn sample's model tokens only (``loss_mask``), whitened over every dp rank's tokens if
``adv_norm``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.interface import Algorithm, CallContext, CallEngine
from rayhf.algorithms.lm import LMInterface, padded, response_forward, rollout_stats
from rayhf.algorithms.offpolicy import OnPolicyConfig
from rayhf.algorithms.ppo import compact, global_whiten, kl_shaped_rewards, masked_mean, spread
from rayhf.algorithms.seqs import pack_per_token, response_index
from rayhf.data.batch import PackedBatch


class ReMaxConfig(OnPolicyConfig):
    """Hyper-parameters of the ReMax reward shaping and loss."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["remax"] = "remax"
    """Selects this algorithm in the config's ``algorithm:`` section."""

    kl_coef: float = Field(0.1, ge=0)
    """Coefficient of the per-token KL penalty against the reference policy."""
    reward_clip: float = Field(20.0, gt=0)
    """Sampled and greedy scores are each clipped to ``[-reward_clip, reward_clip]``."""
    n_minibatches: int = Field(1, gt=0)
    """Optimizer steps per batch; the batch is split into this many minibatches."""
    adv_norm: bool = False
    """Whiten advantages over the valid tokens of every dp rank's batch (PPO's ``global_whiten``)
    before the loss; off by default because the greedy baseline already centres them."""


def remax_advantages(
    sampled_scores: Tensor,
    greedy_scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    reward_clip: float,
) -> Tensor:
    """Undiscounted return-to-go ``[B, T]`` of KL-shaped rewards, used as each token's advantage.

    Every token is penalised by ``kl_coef * (logp - ref)`` of the sampled response; the last
    valid token also gets ``clip(sampled) - clip(greedy)``. Each score is clipped before the
    difference, as PPO clips its one score. 0 on padding and for empty rows.
    """
    clipped_sampled = sampled_scores.clamp(-reward_clip, reward_clip)
    baselined = clipped_sampled - greedy_scores.clamp(-reward_clip, reward_clip)
    # already clipped, so the shaping must not clip the difference again
    rewards, _ = kl_shaped_rewards(baselined, logprobs, ref_logprobs, mask, kl_coef, math.inf)
    returns = rewards.flip(1).cumsum(dim=1).flip(1)
    return torch.where(mask, returns, torch.zeros_like(returns))


def reinforce_loss(
    logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE loss ``-mean(A * logp)`` over the batch's valid tokens; returns ``(loss, stats)``.

    Advantages are detached: they are the return, a constant of the policy gradient, even
    though their KL part was computed from the same log-probs. ``stats``: ``advantage_mean``.
    """
    adv = torch.where(mask, advantages, torch.zeros_like(advantages)).detach()
    loss = -masked_mean(adv * logprobs, mask)
    with torch.no_grad():
        stats = {"advantage_mean": masked_mean(adv, mask).item()}
    return loss, stats


class ReMaxActorInterface(LMInterface):
    """REINFORCE with the greedy response's reward as the baseline (ReMax, Li et al. 2023)."""

    name = "remax_actor"
    config_type = ReMaxConfig

    @property
    def cfg(self) -> ReMaxConfig:
        return self.settings.algorithm

    def add_advantages(self, engine: CallEngine, batch: PackedBatch) -> None:
        """The batch's ``advantages`` key, one per response token: ``remax_advantages`` over the
        trained tokens (a multi-turn sample's model tokens, moved together; 0 on the others),
        whitened over every dp rank's with ``adv_norm``."""
        _, mask = response_index(batch)
        keys = ("logprobs", "ref_logprobs")
        (logp, ref), kept, order = compact([padded(batch, k) for k in keys], mask)
        scores, greedy = (batch.tensors[k].float() for k in ("scores", "greedy_scores"))
        cfg = self.cfg
        adv = remax_advantages(scores, greedy, logp, ref, kept, cfg.kl_coef, cfg.reward_clip)
        adv = spread(adv, order, mask.shape)
        if cfg.adv_norm:
            adv = global_whiten(engine, adv, mask)
        batch.add("advantages", *pack_per_token(batch, adv))

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = rollout_stats(engine, batch)
        stats["greedy_reward"] = engine.all_reduce_mean(
            {"g": batch.tensors["greedy_scores"].float().mean().item()}
        )["g"]
        self.add_advantages(engine, batch)
        temperature = self.temperature

        def loss_fn(mb: PackedBatch):
            logp, _, m = response_forward(engine, mb, temperature)
            loss, s = reinforce_loss(logp, padded(mb, "advantages"), m)
            return loss, {"policy_loss": loss.item(), "kl": masked_mean(
                padded(mb, "logprobs") - padded(mb, "ref_logprobs"), m).item(), **s}  # fmt: skip

        stats.update(engine.train(batch.split(self.cfg.n_minibatches, "seq"), loss_fn))
        return stats


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(ReMaxConfig, (ReMaxActorInterface,))
