"""The shared base of the offline interfaces (``dpo``, ``rm``, ``sft``), which train on fixed data.

``OfflineInterface`` turns a ``loss`` into minibatched optimizer steps (train) and into
held-out statistics averaged over every dp rank without an update (evaluate); ``as_seq`` views one
side of a preference pair as ``seq``. A pair sample holds ``chosen`` and ``rejected`` (each
prompt + response ids) and one ``prompt_lens``; a demonstration holds ``seq`` and ``prompt_lens``.
"""

from __future__ import annotations

import torch

from rayhf.algorithms.interface import CallContext, CallEngine, Interface
from rayhf.data.batch import PackedBatch


def as_seq(batch: PackedBatch, key: str) -> PackedBatch:
    """A view of ``batch`` whose ``seq`` is ``key`` (``chosen`` or ``rejected``)."""
    view = PackedBatch(list(batch.sample_ids))
    view.add("seq", batch.tensors[key], batch.seqlens[key])
    view.add("prompt_lens", batch.tensors["prompt_lens"], batch.seqlens["prompt_lens"])
    return view


class OfflineInterface(Interface):
    """Train = minibatched optimizer steps on ``loss``; evaluate = the loss's stats, no update."""

    def loss(self, engine: CallEngine, mb: PackedBatch) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def train_step(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
    ) -> dict[str, float]:
        n = self.settings.algorithm.n_minibatches
        return engine.train(batch.split(n), lambda mb: self.loss(engine, mb))

    def evaluate(
        self, engine: CallEngine, batch: PackedBatch, ctx: CallContext
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
