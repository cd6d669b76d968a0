"""Critic-free policy-gradient calls: GRPO (group baselines) and ReMax (greedy baseline).

GRPO samples ``group_size`` responses per prompt in its generate call; the train call
normalizes each score within its prompt's group over the *whole* data-parallel batch (the
groups' members may sit on different ranks), then takes clipped-surrogate steps with a k3 KL
term. ReMax's graph generates twice (sampled, and greedy through call args), scores both, and
its train call takes a REINFORCE step with ``r(sampled) - r(greedy)`` as the baseline-corrected
return.
"""

from __future__ import annotations

from typing import cast

import torch

from rayhf.algorithms.grpo import GRPOConfig, grpo_advantages, grpo_loss
from rayhf.algorithms.interface import CallContext, ModelEngine, register
from rayhf.algorithms.lm import (
    LMInterface,
    generation_config,
    padded,
    response_forward,
    sample_batch,
)
from rayhf.algorithms.ppo import masked_mean, masked_whiten
from rayhf.algorithms.remax import ReMaxConfig, reinforce_loss, remax_advantages
from rayhf.algorithms.seqs import pack_rows, response_index
from rayhf.data.batch import PackedBatch


def _rollout_stats(engine: ModelEngine, batch: PackedBatch) -> dict[str, float]:
    lens = torch.tensor(batch.seqlens["seq"]) - batch.tensors["prompt_lens"]
    stats = {
        "task_reward": batch.tensors["scores"].float().mean().item(),
        "response_len": lens.float().mean().item(),
    }
    return engine.all_reduce_mean(stats)


@register("grpo_actor")
class GRPOActorInterface(LMInterface):
    """Generate ``group_size`` samples per prompt; GRPO / Dr. GRPO policy update."""

    config_type = GRPOConfig

    @property
    def cfg(self) -> GRPOConfig:
        return self.settings.algorithm

    def generate(self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        cfg = generation_config(self.settings.generation, ctx.args)
        return sample_batch(engine, batch, cfg, ctx, n_samples=self.cfg.group_size)

    def advantages(self, engine: ModelEngine, batch: PackedBatch, rank: int) -> torch.Tensor:
        """This rank's per-sample advantages, normalized over every rank's groups."""
        mine = (batch.tensors["group_ids"].long(), batch.tensors["scores"].float())
        parts = cast(list[tuple[torch.Tensor, torch.Tensor]], engine.all_gather_object(mine))
        gids = torch.cat([p[0] for p in parts])
        scores = torch.cat([p[1] for p in parts])
        adv = grpo_advantages(scores, gids, self.cfg)
        start = sum(len(p[0]) for p in parts[:rank])
        return adv[start : start + batch.n_samples]

    def train_step(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = _rollout_stats(engine, batch)
        batch.add("advantages", self.advantages(engine, batch, ctx.dp_rank), [1] * batch.n_samples)
        temperature = self.temperature

        def loss_fn(mb: PackedBatch):
            logp, _, mask = response_forward(engine, mb, temperature)
            old, ref = padded(mb, "logprobs"), padded(mb, "ref_logprobs")
            loss, s = grpo_loss(logp, old, ref, mb.tensors["advantages"], mask, self.cfg)
            return loss, {"policy_loss": loss.item(), **s}

        for _ in range(self.cfg.ppo_epochs):
            stats.update(engine.train(batch.split(self.cfg.n_minibatches, "seq"), loss_fn))
        return stats


@register("remax_actor")
class ReMaxActorInterface(LMInterface):
    """REINFORCE with the greedy response's reward as the baseline (ReMax, Li et al. 2023)."""

    config_type = ReMaxConfig

    @property
    def cfg(self) -> ReMaxConfig:
        return self.settings.algorithm

    def train_step(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = _rollout_stats(engine, batch)
        stats["greedy_reward"] = engine.all_reduce_mean(
            {"g": batch.tensors["greedy_scores"].float().mean().item()}
        )["g"]
        _, mask = response_index(batch)
        adv = remax_advantages(
            batch.tensors["scores"].float(), batch.tensors["greedy_scores"].float(),
            padded(batch, "logprobs"), padded(batch, "ref_logprobs"), mask,
            self.cfg.kl_ctl, self.cfg.reward_clip,
        )  # fmt: skip
        if self.cfg.adv_norm:
            adv = masked_whiten(adv, mask)
        packed, lens = pack_rows(adv, mask)
        batch.add("advantages", packed, lens)
        temperature = self.temperature

        def loss_fn(mb: PackedBatch):
            logp, _, m = response_forward(engine, mb, temperature)
            loss, s = reinforce_loss(logp, padded(mb, "advantages"), m)
            return loss, {"policy_loss": loss.item(), "kl": masked_mean(
                padded(mb, "logprobs") - padded(mb, "ref_logprobs"), m).item(), **s}  # fmt: skip

        stats.update(engine.train(batch.split(self.cfg.n_minibatches, "seq"), loss_fn))
        return stats
