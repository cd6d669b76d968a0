"""Supervised fine-tuning: ``SFTConfig``, the cross-entropy loss, and the ``sft`` interface.

The loss is cross entropy on response tokens, a pure torch function. Per-token tensors follow
``rayhf.algorithms.ppo``: right-padded ``[B, T]`` over response tokens with a bool ``mask``;
prompt tokens are never in the mask, so the model is not trained to reproduce prompts. The
``sft`` interface is an offline one (see ``offline``) that trains on demonstrations.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.interface import Algorithm, CallEngine
from rayhf.algorithms.lm import response_forward
from rayhf.algorithms.offline import OfflineInterface
from rayhf.algorithms.offpolicy import OnPolicyConfig
from rayhf.algorithms.ppo import masked_mean
from rayhf.data.batch import PackedBatch


class SFTConfig(OnPolicyConfig):
    """Supervised fine-tuning on prompt/response pairs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["sft"] = "sft"
    """Selects this algorithm in the config's ``algorithm:`` section."""
    n_minibatches: int = Field(1, gt=0)
    """Optimizer steps per batch; the batch is split into this many minibatches."""


def sft_loss(logprobs: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Cross entropy averaged over every valid response token of the batch.

    ``logprobs[:, t]`` is the log-probability of response token ``t``. Averaging over tokens,
    not per sequence, matches Hugging Face's causal-LM loss; padding is ignored. ``stats``:
    ``nll``.
    """
    loss = masked_mean(-logprobs, mask)
    return loss, {"nll": loss.item()}


class SFTInterface(OfflineInterface):
    """Token-level cross entropy on the response tokens of demonstrations."""

    name = "sft"
    config_type = SFTConfig

    @property
    def cfg(self) -> SFTConfig:
        return self.settings.algorithm

    def loss(self, engine: CallEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, _, mask = response_forward(engine, mb)
        return sft_loss(logprobs, mask)


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(SFTConfig, (SFTInterface,))
