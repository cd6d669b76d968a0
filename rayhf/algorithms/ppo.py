"""PPO for RLHF: ``PPOConfig``, the PPO math as pure torch functions, and its two interfaces.

The math (reward shaping, GAE, the clipped policy and value losses, KL controllers) needs no Ray,
no processes and no model code; ``ppo_actor`` (generate, log-prob inference, policy update) and
``ppo_critic`` (value inference, value update) bind it to graph calls. Defaults follow ReaLHF's
PPO interface but ``reward_clip`` (20, which leaves the scores of rayhf's reward functions
unclipped; ReaLHF: 5) and the dual clip of the PPO family (``dual_clip``, verl's c = 3).

Every per-token tensor is right-padded ``[B, T]`` over response tokens only, with a bool ``mask``
that is True on valid tokens, contiguous from position 0 of each row. A row may be empty; every
function returns zeros for it instead of NaN. The data flow of one PPO step:

    scores, logprobs, ref_logprobs --kl_shaped_rewards--> rewards
    rewards, values                --gae_advantages-----> advantages, returns
    advantages (global_whiten)     --ppo_policy_loss----> actor loss
    returns, old values            --ppo_value_loss-----> critic loss

Both train calls derive the same per-token rewards and GAE advantages from the batch (KL to the
reference folded into the rewards), as ReaLHF does, so neither depends on the other's output.
Advantages are whitened over the whole data-parallel batch (sums all-reduced), so the update does
not depend on how the batch was split.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.interface import Algorithm, CallContext, CallEngine, Interface, WorkShape
from rayhf.algorithms.lm import LMInterface, logprob_batch, padded, response_forward
from rayhf.algorithms.offpolicy import (
    LossAgg,
    OffPolicyConfig,
    PolicyReference,
    behaviour_weights,
    bounded_ratio,
    policy_train_shape,
)
from rayhf.algorithms.seqs import pack_per_token, response_index
from rayhf.data.batch import PackedBatch
from rayhf.engines.torch_trainer import Weight, response_tokens, samples
from rayhf.errors import RayhfError


class PPOConfig(OffPolicyConfig):
    """Hyper-parameters of the PPO loss, reward shaping and KL control (and, inherited, how
    stale its samples may be)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["ppo"] = "ppo"
    """Selects this algorithm in the config's ``algorithm:`` section."""

    kl_coef: float = Field(0.1, ge=0)
    """Initial coefficient of the per-token KL penalty against the reference policy."""
    adaptive_kl: bool = False
    """Adapt the KL coefficient towards ``kl_target`` (Ziegler et al.) instead of fixing it."""
    kl_target: float = Field(6.0, gt=0)
    """KL per sequence the adaptive controller steers towards."""
    kl_horizon: int = Field(10000, gt=0)
    """Samples over which the adaptive controller corrects a full proportional error."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount factor of GAE."""
    lam: float = Field(1.0, ge=0, le=1)
    """GAE lambda: 1 gives Monte-Carlo returns, 0 gives one-step TD."""
    eps_clip: float = Field(0.2, gt=0)
    """Policy ratio is clipped to ``[1 - eps_clip, 1 + eps_clip]``."""
    value_eps_clip: float = Field(0.2, gt=0)
    """New values may move at most this far from the old values before clipping applies."""
    reward_clip: float = Field(20.0, gt=0)
    """Reward-model scores are clipped to ``[-reward_clip, reward_clip]``."""
    n_minibatches: int = Field(4, gt=0)
    """Optimizer steps per PPO epoch; the batch is split into this many minibatches."""
    ppo_epochs: int = Field(1, gt=0)
    """Passes over each generated batch."""
    adv_norm: bool = True
    """Whiten advantages over the valid tokens of the batch before the policy loss."""
    entropy_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus subtracted from the policy loss."""


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True; 0 where there are none."""
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim=dim)
    count = mask.sum(dim=dim)
    return total / count.clamp(min=1).to(total.dtype)


def aggregate(per_token: Tensor, mask: Tensor, how: LossAgg) -> Tensor:
    """A per-token loss ``[B, T]`` as one number, ``algorithm.loss_agg``:

    * ``token_mean``: over every valid token of the batch (a long response weighs more);
    * ``seq_mean_token_mean``: each row's token mean, then the mean over rows (each response
      weighs the same);
    * ``seq_mean_token_sum``: each row's token sum, then the mean over rows.

    The row means count every row, an empty one as 0, so a micro-batch's share of the loss is its
    share of the samples (``rayhf.engines.torch_trainer.samples``)."""
    if how == "token_mean":
        return masked_mean(per_token, mask)
    rows = torch.where(mask, per_token, torch.zeros_like(per_token)).sum(dim=1)
    if how == "seq_mean_token_mean":
        rows = rows / mask.sum(dim=1).clamp(min=1).to(rows.dtype)
    return rows.sum() / max(rows.numel(), 1)


def agg_weight(how: LossAgg) -> Weight:
    """What a loss aggregated ``how`` averages over, for the trainer's micro-batches."""
    return response_tokens if how == "token_mean" else samples


def _lengths(mask: Tensor) -> Tensor:
    """Valid tokens per row; asserts the right-padded layout the callers rely on."""
    lengths = mask.sum(dim=1)
    positions = torch.arange(mask.shape[1], device=mask.device)
    assert torch.equal(mask.bool(), positions < lengths.unsqueeze(1)), "mask is not right-padded"
    return lengths


def kl_shaped_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    reward_clip: float,
) -> tuple[Tensor, Tensor]:
    """Per-token rewards: a KL penalty on every token plus the clipped score on the last one.

    Returns ``(rewards, kl)``, both ``[B, T]`` and 0 on padding. The KL estimate is the
    sampled log-ratio ``logprobs - ref_logprobs``; an empty row receives no score.
    """
    lengths = _lengths(mask)
    kl = torch.where(mask, logprobs - ref_logprobs, torch.zeros_like(logprobs))
    rewards = -kl_coef * kl
    if mask.shape[1] == 0:  # no row has a token to score (every token the environment's)
        return rewards, kl
    clipped = scores.to(rewards.dtype).clamp(-reward_clip, reward_clip)
    last = (lengths - 1).clamp(min=0).unsqueeze(1)
    bonus = torch.where(lengths > 0, clipped, torch.zeros_like(clipped)).unsqueeze(1)
    return rewards.scatter_add(1, last, bonus), kl


def compact(xs: list[Tensor], keep: Tensor) -> tuple[list[Tensor], Tensor, Tensor]:
    """Each row's entries where ``keep`` moved left in order, right-padded with 0, for every
    tensor of ``xs``: ``(compacted [B, K] each, their mask, order)``; ``spread`` puts them back.
    With a right-padded ``keep`` (no multi-turn loss mask) it is the identity."""
    n = keep.sum(dim=1)
    width = int(n.max()) if len(n) else 0
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # kept first, in order
    mask = torch.arange(width, device=keep.device).unsqueeze(0) < n.unsqueeze(1)
    outs = [x.gather(1, order[:, :width]) for x in xs]
    return [torch.where(mask, o, torch.zeros_like(o)) for o in outs], mask, order


def spread(y: Tensor, order: Tensor, shape: torch.Size) -> Tensor:
    """``compact``'s inverse: row entries back at their places, 0 elsewhere."""
    return y.new_zeros(shape).scatter(1, order[:, : y.shape[1]], y)


def gae_advantages(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation per row; returns ``(advantages, returns)``.

    The episode ends after the last valid token, so the bootstrap value there is 0.
    Zeroing rewards and values on padding makes the reverse recursion yield exactly that,
    because padding only ever follows the valid tokens.
    """
    _lengths(mask)
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    values = torch.where(mask, values, torch.zeros_like(values))
    next_value = values.new_zeros(values.shape[0])
    running = values.new_zeros(values.shape[0])
    reversed_advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        reversed_advantages.append(running)
        next_value = values[:, t]
    advantages = torch.stack(reversed_advantages[::-1], dim=1) if reversed_advantages else rewards
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, mask: Tensor, low: float, high: float,
    dual_clip: float | None,
) -> tuple[Tensor, dict[str, float]]:  # fmt: skip
    """PPO's per-token loss ``max(-A r, -A clip(r, 1 - low, 1 + high))``, with ``dual_clip``
    ``c`` at most ``-c A`` where ``A < 0``; ``stats``: ``clip_frac`` (tokens where the clipped
    term is the larger loss) and ``dual_clip_frac`` (tokens the dual clip bounds)."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    bounded = torch.zeros_like(mask)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        bounded = (advantages < 0) & (per_token > bound) & mask
        per_token = torch.where(bounded, bound.expand_as(per_token), per_token)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
            "dual_clip_frac": masked_mean(bounded.float(), mask).item(),
        }
    return per_token, stats


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip: float,
    behaviour: Tensor | None = None,
    cfg: OffPolicyConfig | None = None,
    loss_agg: LossAgg = "token_mean",
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate loss (``clipped_surrogate``, with ``cfg.dual_clip``), aggregated as
    ``loss_agg`` says (``aggregate``); returns ``(loss, stats)``. The ratio is bounded
    (``bounded_ratio``), so no token can make the loss or its gradient non-finite.

    With ``behaviour`` log-probs, ``old_logprobs`` are the trainer's own (proximal, or
    recomputed on-policy) and each token's loss is weighted by ``cfg``'s rollout correction
    (``behaviour_weights``: decoupled PPO's ``min(pi_old / pi_behaviour, weight_cap)`` by
    default). ``stats``: ``clip_frac``, ``dual_clip_frac``, ``approx_kl`` (mean of ``old -
    new`` log-probs), ``ratio_mean``, and with ``behaviour`` the weights' ``is_*`` stats.
    """
    cfg = cfg if cfg is not None else OffPolicyConfig()
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = bounded_ratio(log_ratio)
    per_token, stats = clipped_surrogate(ratio, advantages, mask, eps_clip, eps_clip, cfg.dual_clip)
    if behaviour is not None:
        weights, weight_stats = behaviour_weights(old_logprobs, behaviour, mask, cfg)
        per_token = weights * per_token
        stats.update(weight_stats)
    loss = aggregate(per_token, mask, loss_agg)
    with torch.no_grad():
        stats["approx_kl"] = masked_mean(-log_ratio, mask).item()
        stats["ratio_mean"] = masked_mean(ratio, mask).item()
    return loss, stats


def ppo_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, eps_clip: float
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss ``0.5 * max(unclipped, clipped)`` squared error over valid tokens.

    Clipping keeps the critic from moving far from the values the advantages were computed
    with. ``stats``: ``value_clip_frac``, the share of tokens where the clipped term wins.
    """
    clipped_values = old_values + (values - old_values).clamp(-eps_clip, eps_clip)
    loss_unclipped = (values - returns) ** 2
    loss_clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(loss_unclipped, loss_clipped), mask)
    with torch.no_grad():
        clip_frac = masked_mean((loss_clipped > loss_unclipped).float(), mask).item()
    return loss, {"value_clip_frac": clip_frac}


class FixedKLController:
    """KL coefficient that never changes."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op, so callers need not know which controller they hold."""

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``."""
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional KL controller of Ziegler et al. (2019), steering the KL towards a target.

    The error is clipped to ±0.2 so one noisy batch cannot swing the coefficient far.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise RayhfError(f"kl_target and kl_horizon must be > 0, got {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient after ``n_steps`` samples whose mean KL was ``current_kl``."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """Checkpointable state."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from ``state_dict()``."""
        self.value = float(state["value"])
        self.target = float(state["target"])
        self.horizon = int(state["horizon"])


KLController = FixedKLController | AdaptiveKLController


def make_kl_controller(cfg: PPOConfig) -> KLController:
    """The controller ``cfg`` asks for, starting at ``cfg.kl_coef``."""
    if cfg.adaptive_kl:
        return AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    return FixedKLController(cfg.kl_coef)


def global_whiten(engine: CallEngine, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whiten ``x`` over the valid entries of every dp rank's batch."""
    v = x[mask].double()
    count = torch.tensor(v.numel(), dtype=v.dtype, device=v.device)
    sums = engine.all_reduce_sum(torch.stack([v.sum(), (v * v).sum(), count]))
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

    @classmethod
    def work_shape(cls, algorithm: PPOConfig, kind: str) -> WorkShape:
        """A train call goes over its minibatches ``ppo_epochs`` times."""
        return WorkShape(epochs=algorithm.ppo_epochs if kind == "train" else 1)

    def advantages(self, batch: PackedBatch, mask: torch.Tensor):
        """``(advantages, returns, kl, rewards)``, each ``[B, R]``: the KL-shaped rewards and
        GAE over the tokens ``mask`` keeps (a multi-turn call's model tokens: the environment's
        tokens between turns are skipped, not steps of the episode), 0 elsewhere."""
        keys = ("logprobs", "ref_logprobs", "values")
        (logp, ref_logp, values), kept, order = compact([padded(batch, k) for k in keys], mask)
        rewards, kl = kl_shaped_rewards(
            batch.tensors["scores"].float(),
            logp,
            ref_logp,
            kept,
            self.kl_ctl.value,
            self.cfg.reward_clip,
        )
        adv, returns = gae_advantages(rewards, values, kept, self.cfg.gamma, self.cfg.lam)
        return tuple(spread(x, order, mask.shape) for x in (adv, returns, kl, rewards))

    def add_targets(self, engine: CallEngine, batch: PackedBatch) -> dict[str, float]:
        """Put advantages and returns into ``batch``; returns the step's reward statistics."""
        _, mask = response_index(batch)
        adv, returns, kl, _ = self.advantages(batch, mask)
        if self.cfg.adv_norm:
            adv = global_whiten(engine, adv, mask)
        for key, value in (("advantages", adv), ("returns", returns)):
            batch.add(key, *pack_per_token(batch, value))
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


class PPOActorInterface(_PPOBase, LMInterface):
    """The policy: samples responses, scores log-probs (also for the reference), PPO update."""

    name = "ppo_actor"
    policy = True

    @classmethod
    def work_shape(cls, algorithm: PPOConfig, kind: str) -> WorkShape:
        """With ``max_staleness`` > 0 a train call also forwards its proximal share."""
        if kind != "train":
            return WorkShape()
        return policy_train_shape(algorithm, algorithm.ppo_epochs, algorithm.n_minibatches)

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats = self.add_targets(engine, batch)
        cfg = self.cfg
        reference = PolicyReference(engine, batch, self.temperature, cfg, cfg.ppo_epochs, ctx.step)

        def loss_fn(mb: PackedBatch):
            logp, entropies, mask = response_forward(
                engine, mb, self.temperature, cfg.router_replay
            )
            old, behaviour = reference.old(mb, logp, mask)
            adv = padded(mb, "advantages")
            loss, s = ppo_policy_loss(
                logp, old, adv, mask, cfg.eps_clip, behaviour, cfg, cfg.loss_agg
            )  # fmt: skip
            entropy = masked_mean(entropies, mask)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * entropy
            return loss, {"policy_loss": loss.item(), "entropy": entropy.item(), **s}

        for epoch in range(cfg.ppo_epochs):
            minibatches = self.minibatches(batch)
            reference.start_epoch(epoch, minibatches)
            stats.update(engine.train(minibatches, loss_fn, agg_weight(cfg.loss_agg)))
        stats.update(reference.stats(engine))
        self.kl_ctl.update(stats["kl"], n_steps=batch.n_samples * ctx.dp_size)
        return stats


class PPOCriticInterface(_PPOBase):
    """The value function: per-token values, clipped value-loss update toward GAE returns."""

    name = "ppo_critic"

    def inference(self, engine: CallEngine, batch: PackedBatch, ctx: CallContext) -> PackedBatch:
        return logprob_batch(engine, batch, 1.0, key="values")

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
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


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(PPOConfig, (PPOActorInterface, PPOCriticInterface))
