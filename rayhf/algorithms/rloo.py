"""RLOO, REINFORCE with a leave-one-out baseline (Ahmadian et al., "Back to Basics", 2024):
``RLOOConfig``, its sequence-level loss, and ``rloo_actor``.

Each prompt is sampled ``group_size`` (k) times, as in GRPO. The KL to the reference (the
generator's log-ratio summed over the response, k1) is taken out of each sample's reward, and
each sample is compared with the mean of the *other* samples of its prompt, with no division by
a std; every token of the sample shares that advantage:

    reward_i    = score_i - kl_coef * sum_t (logprob_t - ref_logprob_t)
    advantage_i = reward_i - (sum_j reward_j - reward_i) / (k - 1)
                = k / (k - 1) * (reward_i - mean_j reward_j)

The update, ``ratio_level``:

    token (default)  GRPO's clipped surrogate per token, token-mean, no KL term (``grpo_loss``
                     at ``kl_coef`` 0): r_t = pi(y_t) / pi_old(y_t)
    sequence         one ratio per response, r_i = exp(sum_t (logprob_t - old_logprob_t)),
                     max(-A_i r_i, -A_i clip(r_i, 1 - eps_clip, 1 + eps_clip)), mean over
                     responses (``sequence_ratio_loss``)

Both clip at ``eps_clip`` (0.2) and dual-clip as ``dual_clip`` says (c = 3, verl's; TRL and
OpenRLHF do not by default). How the references compare:

* verl's ``rloo`` estimator with ``use_kl_in_reward`` (its RLOO example: k1, ``kl_coef`` 0.001)
  sums the KL into the score before the leave-one-out and takes the token surrogate with dual
  clip c = 3: the default here, but for ``kl_coef`` (0.05 here, TRL's).
* TRL's ``RLOOTrainer`` (the 2024 one and its 2025 rewrite alike) forms this reward (``beta``
  0.05, k1 summed, from the trainer's log-probs at sampling rather than the generator's) and
  this advantage (``normalize_advantages`` off), and takes the ``sequence`` loss without a dual
  clip. It samples 2 per prompt (``num_generations``, ``rloo_k``); ``group_size`` here is 4.
* OpenRLHF's ``--advantage_estimator rloo`` takes the leave-one-out baseline of the score alone
  and puts the KL (k1, coefficient 0.01) in per-token rewards, so token t's advantage is
  ``score_i - baseline_i - kl_coef * sum_{s >= t} kl_s``: its own KL to go, not compared with
  the other samples'. Its loss is the ``token`` one (token-mean, no whitening for rloo).

Asynchronous training (``max_staleness``) works as it does for GRPO; at the ``sequence`` level a
response's loss is weighted by the mean of its tokens' rollout-correction weights (with
``correction_level: sequence``, its own weight).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.grpo import GRPOActorInterface, GRPOConfig, over_groups
from rayhf.algorithms.interface import Algorithm, CallEngine
from rayhf.algorithms.lm import padded
from rayhf.algorithms.offpolicy import behaviour_weights, bounded_ratio
from rayhf.algorithms.ppo import clipped_surrogate, masked_mean
from rayhf.algorithms.seqs import response_index
from rayhf.data.batch import PackedBatch
from rayhf.engines.torch_trainer import Weight, samples


class RLOOConfig(GRPOConfig):
    """RLOO: GRPO's sampling, the KL in the reward and a leave-one-out baseline; GRPO's token
    update or TRL's sequence-level one."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["rloo"] = "rloo"  # type: ignore[assignment]
    """Selects this algorithm in the config's ``algorithm:`` section."""
    kl_coef: float = Field(0.05, ge=0)
    """Weight of the sample's KL to the reference (its summed log-ratio), taken from its reward."""
    kl_estimator: Literal["k1"] = "k1"  # type: ignore[assignment]
    """RLOO's KL is the reward's summed log-ratio (k1); the loss has no KL term to estimate."""
    ratio_level: Literal["token", "sequence"] = "token"
    """``token``: GRPO's clipped surrogate per token, token-mean (OpenRLHF's loss); ``sequence``:
    one ratio per response, exp of its summed token log-ratios, clipped, mean over responses
    (TRL's RLOOTrainer)."""

    @model_validator(mode="after")
    def _sequences_average_once(self) -> RLOOConfig:
        if self.ratio_level == "sequence" and (self.dr_grpo or self.loss_agg != "token_mean"):
            raise ValueError(
                "algorithm.ratio_level: sequence averages over responses; leave loss_agg and "
                "dr_grpo unset or set ratio_level: token"
            )
        return self


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


def sequence_ratio_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: GRPOConfig,
    behaviour: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """TRL's RLOO loss: per response ``r_i = exp(sum_t (logprobs - old))`` (``bounded_ratio``),
    PPO's clipped loss on it (``clipped_surrogate``: ``cfg.clip_range()``, ``cfg.dual_clip``),
    summed over responses and divided by their number, an empty one adding 0 (the trainer
    weighs micro-batches by ``samples``). ``advantages`` is ``[B]``.

    With ``behaviour`` log-probs a response's loss is weighted by the mean of its tokens'
    rollout-correction weights (``behaviour_weights``). ``stats``: ``clip_frac`` and
    ``dual_clip_frac`` (shares of responses), ``approx_kl`` (token mean of ``old - new``),
    ``seq_ratio_mean``, and with ``behaviour`` the weights' ``is_*`` stats."""
    assert advantages.shape == logprobs.shape[:1], "advantages must be [B], one per sequence"
    rows = mask.any(dim=1)
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = bounded_ratio(log_ratio.sum(dim=1))
    low, high = cfg.clip_range()
    adv = advantages.to(ratio.dtype)
    per_seq, stats = clipped_surrogate(ratio, adv, rows, low, high, cfg.dual_clip)
    if behaviour is not None:
        weights, weight_stats = behaviour_weights(old_logprobs, behaviour, mask, cfg)
        per_seq = per_seq * masked_mean(weights, mask, dim=1)
        stats.update(weight_stats)
    loss = torch.where(rows, per_seq, torch.zeros_like(per_seq)).sum() / max(len(rows), 1)
    with torch.no_grad():
        stats["approx_kl"] = masked_mean(-log_ratio, mask).item()
        stats["seq_ratio_mean"] = masked_mean(ratio, rows).item()
    return loss, stats


class RLOOActorInterface(GRPOActorInterface):
    """``group_size`` samples per prompt; RLOO's advantages, GRPO's clipped update per token or
    TRL's per sequence (``ratio_level``)."""

    name = "rloo_actor"
    config_type = RLOOConfig

    @property
    def loss_config(self) -> GRPOConfig:
        return self.cfg.model_copy(update={"kl_coef": 0.0})  # the KL is in the reward

    @property
    def per_sequence(self) -> bool:
        return cast(RLOOConfig, self.cfg).ratio_level == "sequence"

    @property
    def loss_weight(self) -> Weight:
        return samples if self.per_sequence else super().loss_weight

    def policy_loss(
        self, logp: Tensor, old: Tensor, ref: Tensor, adv: Tensor, mask: Tensor,
        behaviour: Tensor | None,
    ) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
        if not self.per_sequence:
            return super().policy_loss(logp, old, ref, adv, mask, behaviour)
        return sequence_ratio_loss(logp, old, adv, mask, self.cfg, behaviour)

    def advantages(self, engine: CallEngine, batch: PackedBatch, rank: int) -> Tensor:
        """This rank's leave-one-out advantages of KL-penalized rewards, over every rank's
        groups."""
        _, mask = response_index(batch)
        logp, ref = padded(batch, "logprobs"), padded(batch, "ref_logprobs")
        rewards = kl_rewards(batch.tensors["scores"].float(), logp, ref, mask, self.cfg.kl_coef)
        return over_groups(engine, batch, rank, rewards, loo_advantages)


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(RLOOConfig, (RLOOActorInterface,))
