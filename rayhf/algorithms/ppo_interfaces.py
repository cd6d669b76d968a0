"""PPO's calls: the actor (generate, log-prob inference, policy update) and the critic.

Both train calls derive the same per-token rewards and GAE advantages from the batch (KL to the
reference folded into the rewards), as ReaLHF does, so neither depends on the other's output.
Advantages are whitened over the whole data-parallel batch (sums all-reduced), so the update does
not depend on how the batch was split.
"""

from __future__ import annotations

from typing import Any

import torch

from rayhf.algorithms.interface import CallContext, Interface, ModelEngine, register
from rayhf.algorithms.lm import LMInterface, logprob_batch, padded, response_forward
from rayhf.algorithms.ppo import (
    PPOConfig,
    entropy_from_logits,
    gae_advantages,
    kl_shaped_rewards,
    make_kl_controller,
    masked_mean,
    ppo_policy_loss,
    ppo_value_loss,
)
from rayhf.algorithms.seqs import pack_rows, response_index
from rayhf.data.batch import PackedBatch


def _global_whiten(engine: ModelEngine, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whiten ``x`` over the valid entries of every dp rank's batch."""
    v = x[mask].double()
    sums = engine.all_reduce_sum(torch.stack([v.sum(), (v * v).sum(), torch.tensor(v.numel())]))
    n = max(float(sums[2]), 1.0)
    mean = sums[0] / n
    var = (sums[1] / n - mean * mean).clamp(min=0.0)
    out = (x - mean.float()) * torch.rsqrt(var.float() + 1e-8)
    return torch.where(mask, out, torch.zeros_like(out))


class _PPOBase(Interface):
    """Reward shaping and GAE shared by the actor and critic train calls."""

    config_type = PPOConfig

    @property
    def cfg(self) -> PPOConfig:
        return self.settings.algorithm

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.kl_ctl = make_kl_controller(self.cfg)

    def advantages(self, batch: PackedBatch, mask: torch.Tensor):
        """``(advantages, returns, kl, rewards)``, each ``[B, R]``."""
        logp, ref_logp = padded(batch, "logprobs"), padded(batch, "ref_logprobs")
        rewards, kl = kl_shaped_rewards(
            batch.tensors["scores"].float(),
            logp,
            ref_logp,
            mask,
            self.kl_ctl.value,
            self.cfg.reward_clip,
        )
        adv, returns = gae_advantages(
            rewards, padded(batch, "values"), mask, self.cfg.gamma, self.cfg.lam
        )
        return adv, returns, kl, rewards

    def add_targets(self, engine: ModelEngine, batch: PackedBatch) -> dict[str, float]:
        """Put advantages and returns into ``batch``; returns the step's reward statistics."""
        _, mask = response_index(batch)
        adv, returns, kl, _ = self.advantages(batch, mask)
        if self.cfg.adv_norm:
            adv = _global_whiten(engine, adv, mask)
        for key, value in (("advantages", adv), ("returns", returns)):
            packed, lens = pack_rows(value, mask)
            batch.add(key, packed, lens)
        resp_len = mask.sum(1).float()
        stats = {
            "task_reward": batch.tensors["scores"].float().mean().item(),
            "kl": kl.sum(1).mean().item(),
            "response_len": resp_len.mean().item(),
            "kl_coef": self.kl_ctl.value,
        }
        return engine.all_reduce_mean(stats)

    def minibatches(self, batch: PackedBatch) -> list[PackedBatch]:
        # every dp rank makes the same number of minibatches (some may be empty)
        return batch.split(self.cfg.n_minibatches, by_key="seq")

    def state_dict(self) -> dict[str, Any]:
        return {"kl_ctl": self.kl_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.kl_ctl.load_state_dict(state["kl_ctl"])


@register("ppo_actor")
class PPOActorInterface(_PPOBase, LMInterface):
    """The policy: samples responses, scores log-probs (also for the reference), PPO update."""

    def train_step(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = self.add_targets(engine, batch)

        def loss_fn(mb: PackedBatch):
            logp, logits, mask = response_forward(engine, mb, self.temperature)
            loss, s = ppo_policy_loss(
                logp, padded(mb, "logprobs"), padded(mb, "advantages"), mask, self.cfg.eps_clip
            )
            entropy = masked_mean(entropy_from_logits(logits), mask)
            if self.cfg.entropy_coef:
                loss = loss - self.cfg.entropy_coef * entropy
            return loss, {"policy_loss": loss.item(), "entropy": entropy.item(), **s}

        for _ in range(self.cfg.ppo_epochs):
            stats.update(engine.train(self.minibatches(batch), loss_fn))
        self.kl_ctl.update(stats["kl"], n_steps=batch.n_samples * ctx.dp_size)
        return stats


@register("ppo_critic")
class PPOCriticInterface(_PPOBase):
    """The value function: per-token values, clipped value-loss update toward GAE returns."""

    def inference(self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        return logprob_batch(engine, batch, 1.0, key="values")

    def train_step(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = self.add_targets(engine, batch)

        def loss_fn(mb: PackedBatch):
            values, _, mask = response_forward(engine, mb, 1.0)
            loss, s = ppo_value_loss(
                values,
                padded(mb, "values"),
                padded(mb, "returns"),
                mask,
                self.cfg.value_eps_clip,
            )
            return loss, {"value_loss": loss.item(), **s}

        for _ in range(self.cfg.ppo_epochs):
            stats.update(engine.train(self.minibatches(batch), loss_fn))
        self.kl_ctl.update(stats["kl"], n_steps=batch.n_samples * ctx.dp_size)
        return {k: v for k, v in stats.items() if k in ("value_loss", "value_clip_frac")}
