"""DAPO, Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., 2025):
``DAPOConfig``, its pure functions and ``dapo_actor``.

GRPO's groups and update with four changes, each switchable in ``algorithm:``:

* clip-higher: the ratio is clipped to ``[1 - eps_clip, 1 + eps_clip_high]``, a wider upper
  bound, so a token the policy rarely samples can gain probability (``eps_clip_high: 0.2``
  turns it off at GRPO's defaults);
* dynamic sampling: a group whose scores are all equal has advantage 0 and teaches nothing, so
  the step drops it and samples more prompts from the dataset until the batch holds
  ``batch_size`` groups that differ (``rayhf.runtime.refill`` runs it;
  ``rayhf.algorithms.refill`` keeps the groups and says when to stop). By default it refills
  until full, and stops the run if a step draws a whole dataset's worth of rows without
  filling; ``max_rounds`` caps the generations a step may run, and at that cap a short batch
  stops the run unless ``short_batch: train``;
* token-level loss: ``loss_agg: token_mean`` (the default of the PPO family here);
* overlong reward shaping: a response longer than ``max_new_tokens - overlong_buffer`` loses
  up to ``overlong_penalty`` linearly over the buffer (``overlong_shaping``), so the policy
  learns the length limit without a truncated answer's noise; the buffer is a fifth of
  ``max_new_tokens`` unless set, as the paper's 4096 of 20480 tokens.

No KL term by default (``kl_coef: 0``), as the paper.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import Tensor

from rayhf.algorithms.grpo import GRPOActorInterface, GRPOConfig, grpo_advantages, over_groups
from rayhf.algorithms.interface import Algorithm, CallEngine
from rayhf.algorithms.refill import GroupRefill, ShortBatch
from rayhf.algorithms.seqs import response_lengths
from rayhf.data.batch import PackedBatch

OVERLONG_SHARE = 5  # the default buffer is max_new_tokens // 5: the paper's 4096 of 20480


class DAPOConfig(GRPOConfig):
    """DAPO: GRPO with clip-higher, dynamic sampling, the token-level loss and overlong reward
    shaping."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["dapo"] = "dapo"  # type: ignore[assignment]
    """Selects this algorithm in the config's ``algorithm:`` section."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of GRPO's per-token k3 KL term (the paper uses none)."""
    eps_clip_high: float = Field(0.28, gt=0)
    """Clip-higher: the ratio is clipped above at ``1 + eps_clip_high`` (below at
    ``1 - eps_clip``); equal to ``eps_clip`` turns it off."""
    dynamic_sampling: bool = True
    """Drop the groups whose scores are all equal and fill the batch with more prompts."""
    max_rounds: int | None = Field(None, gt=0)
    """Generations a step may run to fill its batch (the first included); None refills until
    full, and stops the run once a step has drawn a whole dataset's worth of rows."""
    short_batch: ShortBatch = "error"
    """At the limit with fewer than ``batch_size`` groups kept: ``error`` stops the run,
    ``train`` trains on the groups kept (at least one) and logs a warning."""
    overlong_buffer: int | None = Field(None, ge=0)
    """Tokens before ``generation.max_new_tokens`` where the length penalty starts; None: a
    fifth of ``max_new_tokens`` (the paper: 4096 of 20480); 0 turns the shaping off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """The penalty at the length limit, subtracted from the score."""

    @model_validator(mode="after")
    def _dapo_settings(self) -> DAPOConfig:
        if self.eps_clip_high < self.eps_clip:
            raise ValueError(
                f"algorithm.eps_clip_high ({self.eps_clip_high:g}) is below algorithm.eps_clip "
                f"({self.eps_clip:g}): clip-higher needs eps_clip_high >= eps_clip"
            )
        if self.dynamic_sampling and self.max_staleness:
            raise ValueError(
                "algorithm.dynamic_sampling: a refill waits for the step's scores; set "
                "max_staleness: 0 or dynamic_sampling: false"
            )
        if self.dr_grpo:
            raise ValueError("algorithm.dr_grpo: DAPO sets loss_agg instead; set it false")
        return self

    def clip_range(self) -> tuple[float, float]:
        return self.eps_clip, self.eps_clip_high

    def refill(self) -> GroupRefill | None:
        """What a step keeps and how many generations it may run to fill its batch; None: no
        refill (the runtime asks this, not the algorithm's name)."""
        if not self.dynamic_sampling:
            return None
        return GroupRefill(self.max_rounds, self.short_batch)

    def overlong_tokens(self, max_new_tokens: int) -> int:
        """The overlong buffer in tokens: ``overlong_buffer``, else a fifth of the limit."""
        if self.overlong_buffer is None:
            return max_new_tokens // OVERLONG_SHARE
        return self.overlong_buffer


def overlong_shaping(lengths: Tensor, max_len: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment per response (eq. 13, times ``penalty``): 0 up to
    ``max_len - buffer`` tokens, then falling linearly to ``-penalty`` at ``max_len``, and
    ``-penalty`` beyond it. 0 everywhere when ``buffer`` is 0."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0, max=buffer)
    return -penalty * over / buffer


class DAPOActorInterface(GRPOActorInterface):
    """``group_size`` samples per prompt; GRPO's advantages of the shaped scores, clip-higher."""

    name = "dapo_actor"
    config_type = DAPOConfig

    def advantages(self, engine: CallEngine, batch: PackedBatch, rank: int) -> Tensor:
        """Group-normalized advantages of each score plus its overlong shaping."""
        cfg = self.cfg
        assert isinstance(cfg, DAPOConfig)
        lengths = torch.tensor(response_lengths(batch))
        limit = self.settings.generation.max_new_tokens
        buffer = cfg.overlong_tokens(limit)
        shaped = batch.tensors["scores"].float() + overlong_shaping(
            lengths, limit, buffer, cfg.overlong_penalty
        )
        return over_groups(engine, batch, rank, shaped, lambda x, g: grpo_advantages(x, g, cfg))


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(DAPOConfig, (DAPOActorInterface,))
