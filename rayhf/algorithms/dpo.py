"""DPO: ``DPOConfig``, the loss as pure torch functions, and the ``dpo`` interface.

DPO trains on preference pairs without a reward model or sampling. The policy's log-ratio against
a frozen reference is an implicit reward ``beta * log(pi / ref)``; DPO fits a Bradley-Terry model
on the difference of those rewards (Rafailov et al., 2023):

    token logprobs of chosen / rejected (policy and ref) --sequence_logprob--> [B] each
    the four sequence log-probs                          --dpo_loss---------> loss

Per-token tensors follow ``rayhf.algorithms.ppo``: right-padded ``[B, T]`` with a bool ``mask``.
The ``dpo`` interface is an offline one (see ``offline``): its train call takes the reference's
per-token log-probs of both sides from the batch.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.interface import Algorithm, CallEngine
from rayhf.algorithms.lm import padded, response_forward
from rayhf.algorithms.offline import OfflineInterface, as_seq
from rayhf.algorithms.offpolicy import OnPolicyConfig
from rayhf.data.batch import PackedBatch


class DPOConfig(OnPolicyConfig):
    """Hyper-parameters of the DPO loss."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["dpo"] = "dpo"
    """Selects this algorithm in the config's ``algorithm:`` section."""

    beta: float = Field(0.1, gt=0)
    """Scale of the implicit reward ``beta * log(pi / ref)``; smaller keeps pi closer to ref."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Assumed probability that a preference label is flipped (conservative DPO); 0 is DPO."""
    n_minibatches: int = Field(1, gt=0)
    """Optimizer steps per batch; the batch is split into this many minibatches."""


def sequence_logprob(logprobs: Tensor, mask: Tensor) -> Tensor:
    """Log-probability ``[B]`` of each response: its valid token log-probs summed, 0 if empty."""
    return torch.where(mask, logprobs, torch.zeros_like(logprobs)).sum(dim=1)


def dpo_loss(
    pi_chosen: Tensor,
    pi_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Mean over pairs of ``-(1-ls) logsigmoid(beta m) - ls logsigmoid(-beta m)``.

    ``m = (pi_chosen - ref_chosen) - (pi_rejected - ref_rejected)``, all sequence log-probs
    ``[B]``. With ``ls > 0`` the loss is smallest at a finite margin, so noisy labels cannot push
    the policy arbitrarily far. ``stats``: ``reward_margin`` (mean ``beta m``),
    ``reward_accuracy`` (share of pairs with ``m > 0``; ties count as wrong),
    ``chosen_reward`` and ``rejected_reward`` (mean implicit rewards).
    """
    chosen_reward = beta * (pi_chosen - ref_chosen)
    rejected_reward = beta * (pi_rejected - ref_rejected)
    logits = chosen_reward - rejected_reward
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits)
    losses = losses - label_smoothing * F.logsigmoid(-logits)
    with torch.no_grad():
        stats = {
            "reward_margin": logits.mean().item(),
            "reward_accuracy": (logits > 0).float().mean().item(),
            "chosen_reward": chosen_reward.mean().item(),
            "rejected_reward": rejected_reward.mean().item(),
        }
    return losses.mean(), stats


class DPOInterface(OfflineInterface):
    """Direct preference optimization against the reference's sequence log-probs."""

    name = "dpo"
    config_type = DPOConfig
    sequence_keys = ("chosen", "rejected")

    @property
    def cfg(self) -> DPOConfig:
        return self.settings.algorithm

    def loss(self, engine: CallEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        pi = {}
        for key in ("chosen", "rejected"):
            logp, _, mask = response_forward(engine, as_seq(mb, key))
            ref = sequence_logprob(padded(mb, f"ref_{key}_logprobs"), mask)
            pi[key] = (sequence_logprob(logp, mask), ref)
        loss, stats = dpo_loss(
            pi["chosen"][0], pi["rejected"][0], pi["chosen"][1], pi["rejected"][1],
            self.cfg.beta, self.cfg.label_smoothing,
        )  # fmt: skip
        return loss, {"dpo_loss": loss.item(), **stats}


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(DPOConfig, (DPOInterface,))
