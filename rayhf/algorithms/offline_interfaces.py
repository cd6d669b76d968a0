"""Training on fixed data: DPO and reward models on preference pairs, SFT on demonstrations.

A pair sample holds ``chosen`` and ``rejected`` (each prompt + response ids) and one
``prompt_lens``; a demonstration holds ``seq`` and ``prompt_lens``. Each train call also has an
``evaluate`` that computes the same statistics on held-out data without an update.
"""

from __future__ import annotations

import torch

from rayhf.algorithms.dpo import DPOConfig, dpo_loss, sequence_logprob
from rayhf.algorithms.interface import CallContext, Interface, ModelEngine, register
from rayhf.algorithms.lm import padded, response_forward
from rayhf.algorithms.rm import RMConfig, bradley_terry_loss, final_token_scores
from rayhf.algorithms.seqs import padded_inputs, response_index, response_labels
from rayhf.algorithms.sft import SFTConfig, sft_loss
from rayhf.data.batch import PackedBatch


def as_seq(batch: PackedBatch, key: str) -> PackedBatch:
    """A view of ``batch`` whose ``seq`` is ``key`` (``chosen`` or ``rejected``)."""
    view = PackedBatch(list(batch.sample_ids))
    view.add("seq", batch.tensors[key], batch.seqlens[key])
    view.add("prompt_lens", batch.tensors["prompt_lens"], batch.seqlens["prompt_lens"])
    return view


class _OfflineInterface(Interface):
    """Train = minibatched optimizer steps on ``loss``; evaluate = the loss's stats, no update."""

    def loss(self, engine: ModelEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def train_step(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        n = self.settings.algorithm.n_minibatches
        return engine.train(batch.split(n), lambda mb: self.loss(engine, mb))

    def evaluate(
        self, engine: ModelEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        stats: dict[str, float] = {}
        if batch.n_samples:
            with torch.no_grad():
                _, stats = self.loss(engine, batch)
        # every rank joins the all-reduce, weighting its mean by its sample count
        weighted = {k: v * batch.n_samples for k, v in stats.items()}
        totals = engine.all_gather_object((weighted, batch.n_samples))
        n_total = sum(t[1] for t in totals)  # type: ignore[index]
        keys = {k for t in totals for k in t[0]}  # type: ignore[index]
        return {k: sum(t[0].get(k, 0.0) for t in totals) / n_total for k in keys}  # type: ignore[index]


@register("dpo")
class DPOInterface(_OfflineInterface):
    """Direct preference optimization against the reference's sequence log-probs."""

    config_type = DPOConfig

    @property
    def cfg(self) -> DPOConfig:
        return self.settings.algorithm

    def loss(self, engine: ModelEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
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


@register("rm")
class RewardModelInterface(_OfflineInterface):
    """Bradley-Terry training of a value-head model on the final-token scores of pairs."""

    config_type = RMConfig

    @property
    def cfg(self) -> RMConfig:
        return self.settings.algorithm

    def loss(self, engine: ModelEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        scores = {}
        for key in ("chosen", "rejected"):
            ids, attn = padded_inputs(as_seq(mb, key), engine.pad_id)
            values = engine.forward(ids, attn).cpu()
            scores[key] = final_token_scores(values, torch.tensor(mb.seqlens[key]))
        loss, stats = bradley_terry_loss(scores["chosen"], scores["rejected"])
        return loss, {"rm_loss": loss.item(), **stats}


@register("sft")
class SFTInterface(_OfflineInterface):
    """Token-level cross entropy on the response tokens of demonstrations."""

    config_type = SFTConfig

    @property
    def cfg(self) -> SFTConfig:
        return self.settings.algorithm

    def loss(self, engine: ModelEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        _, logits, mask = response_forward(engine, mb)
        ids, _ = padded_inputs(mb, engine.pad_id)
        positions, _ = response_index(mb)
        return sft_loss(logits, response_labels(ids, positions), mask)
