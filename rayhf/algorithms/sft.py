"""Supervised fine-tuning loss as a pure torch function: cross entropy on response tokens.

Per-token tensors follow ``rayhf.algorithms.ppo``: right-padded ``[B, T]`` over response tokens
with a bool ``mask``; prompt tokens are never in the mask, so the model is not trained to
reproduce prompts.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.ppo import masked_mean, token_logprobs


class SFTConfig(BaseModel):
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
