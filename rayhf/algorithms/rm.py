"""Reward-model training: ``RMConfig``, the Bradley-Terry loss as pure torch functions, and ``rm``.

A reward model is a value-head model; its score for a sequence is its value at the sequence's
last token, the only position that has attended to the whole sequence:

    values [B, L] of chosen / rejected --final_token_scores--> scores [B] each
    chosen, rejected scores            --bradley_terry_loss--> loss

The ``rm`` interface is an offline one (see ``offline``) that trains on preference pairs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch import Tensor

from rayhf.algorithms.interface import Algorithm, CallEngine
from rayhf.algorithms.offline import OfflineInterface, as_seq
from rayhf.algorithms.offpolicy import OnPolicyConfig
from rayhf.algorithms.seqs import padded_inputs
from rayhf.data.batch import PackedBatch


class RMConfig(OnPolicyConfig):
    """Bradley-Terry reward-model training on preference pairs."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    name: Literal["rm"] = "rm"
    """Selects this algorithm in the config's ``algorithm:`` section."""
    n_minibatches: int = Field(1, gt=0)
    """Optimizer steps per batch; the batch is split into this many minibatches."""


def final_token_scores(values: Tensor, seq_lens: Tensor) -> Tensor:
    """Each row's value at its last token ``[B]``; ``values`` is right-padded ``[B, L]``.

    ``seq_lens`` counts the whole sequence (prompt and response), so it is at least 1.
    """
    assert values.dim() == 2 and seq_lens.shape == values.shape[:1], "need [B, L] and [B]"
    lens = seq_lens.long().to(values.device)
    assert bool(((lens >= 1) & (lens <= values.shape[1])).all()), "seq_lens must be in [1, L]"
    return values.gather(1, (lens - 1).unsqueeze(1)).squeeze(1)


def bradley_terry_loss(
    chosen_scores: Tensor, rejected_scores: Tensor
) -> tuple[Tensor, dict[str, float]]:
    """Mean of ``-logsigmoid(chosen - rejected)``: the NLL of the labels under Bradley-Terry.

    ``stats``: ``accuracy`` (share of pairs with chosen > rejected; ties count as wrong) and
    ``margin`` (mean of chosen - rejected).
    """
    margin = chosen_scores - rejected_scores
    loss = -F.logsigmoid(margin).mean()
    with torch.no_grad():
        stats = {
            "accuracy": (margin > 0).float().mean().item(),
            "margin": margin.mean().item(),
        }
    return loss, stats


class RewardModelInterface(OfflineInterface):
    """Bradley-Terry training of a value-head model on the final-token scores of pairs."""

    name = "rm"

    sequence_keys = ("chosen", "rejected")
    config_type = RMConfig

    @property
    def cfg(self) -> RMConfig:
        return self.settings.algorithm

    def loss(self, engine: CallEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        scores = {}
        for key in ("chosen", "rejected"):
            ids, attn = padded_inputs(as_seq(mb, key), engine.pad_id)
            values = engine.forward(ids, attn).cpu()
            scores[key] = final_token_scores(values, torch.tensor(mb.seqlens[key]))
        loss, stats = bradley_terry_loss(scores["chosen"], scores["rejected"])
        return loss, {"rm_loss": loss.item(), **stats}


# the registration (rayhf.config.registry lists it)
ALGORITHM = Algorithm(RMConfig, (RewardModelInterface,))
