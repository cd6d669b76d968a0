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

from rayhf.algorithms.interface import ModelEngine, register
from rayhf.algorithms.lm import response_forward, token_logprobs
from rayhf.algorithms.offline import OfflineInterface
from rayhf.algorithms.offpolicy import OnPolicyConfig
from rayhf.algorithms.ppo import masked_mean
from rayhf.algorithms.seqs import padded_inputs, response_index, response_labels
from rayhf.data.batch import PackedBatch


class SFTConfig(OnPolicyConfig):
    """Supervised fine-tuning on prompt/response pairs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["sft"] = "sft"
    """Selects this algorithm in the config's ``algorithm:`` section."""
    n_minibatches: int = Field(1, gt=0)
    """Optimizer steps per batch; the batch is split into this many minibatches."""


def sft_loss(logits: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, float]]:
    """Cross entropy averaged over every valid response token of the batch.

    ``logits[:, t]`` is the prediction of ``labels[:, t]`` (already shifted). Averaging over
    tokens, not per sequence, matches Hugging Face's causal-LM loss. Labels on padding are
    ignored, even ones such as -100 that do not index the vocabulary. ``stats``: ``nll``.
    """
    safe_labels = torch.where(mask, labels, torch.zeros_like(labels))
    nll = -token_logprobs(logits, safe_labels)
    loss = masked_mean(nll, mask)
    return loss, {"nll": loss.item()}


@register("sft")
class SFTInterface(OfflineInterface):
    """Token-level cross entropy on the response tokens of demonstrations."""

    config_type = SFTConfig

    @property
    def cfg(self) -> SFTConfig:
        return self.settings.algorithm

    def loss(self, engine: ModelEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        _, logits, mask = response_forward(engine, mb)
        ids, _ = padded_inputs(mb, engine.pad_id)
        positions, _ = response_index(mb)
        labels = response_labels(ids, positions).to(logits.device)
        return sft_loss(logits, labels, mask.to(logits.device))
