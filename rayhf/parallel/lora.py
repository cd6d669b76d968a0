"""LoRA adapters on a rank's shards (``rayhf.models.lora``): added beside the weights they adapt,
applied unmerged, with the autograd rules of the split they follow.

- column-parallel: ``(x A^T) B_local^T``, A read through ``copy_to_tp``: each rank's gradient
  of A covers only its output rows, so they are summed over tp (as a column-parallel layer's
  input gradient is). Where the weight is whole on every rank, nothing is summed.
- row-parallel: ``z = reduce_from_tp(x_local A_local^T)`` (the rank's columns' share of
  ``x A^T``, summed), then ``z B^T`` added after the weight's own sum: every rank computes the
  same ``z`` and the same gradient of B, and gets the gradient of its own columns of A.

With ``Lora.dropout`` p, in training the adapter reads ``x`` with each element kept with
probability 1 - p and scaled by 1 / (1 - p), as PEFT's ``lora_dropout``. The mask is drawn from
torch's generator for the whole input, ``[tokens, in]``, and a row-parallel rank keeps its
columns of it: the ranks of a tp group, seeded alike for a train call (``dropout_seeded``), draw the
same mask, the one a tp = 1 rank draws, and activation checkpointing's recomputation, which
restores the generator, draws it again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from rayhf.models.sharding import AdapterPair, adapter_pairs
from rayhf.parallel.tp import copy_to_tp, reduce_from_tp

if TYPE_CHECKING:
    from rayhf.parallel.model import ShardedModel


def adapters_of(model: ShardedModel) -> dict[str, AdapterPair]:
    """The adapter pairs of the weights ``model`` holds, by the weight's name."""
    return {pair.weight: pair for pair in adapter_pairs(model.spec, model.shards.values())}


def unreduced_term(
    model: ShardedModel, x: torch.Tensor, pair: AdapterPair, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A column-parallel or whole weight's adapter term of ``x``: this rank's output columns
    (``dtype``: with the adapters cast to it, as an LM head computed in fp32 does)."""
    group = model.groups.tp_group if pair.split == "column" else None
    a, b = model.param(pair.a.name), model.param(pair.b.name)
    if dtype is not None:
        a, b = a.to(dtype), b.to(dtype)
    a = copy_to_tp(a, group)
    return (_dropped(model, x, 1, 0) @ a.T) @ b.T * _scale(model)


def reduced_term(model: ShardedModel, x: torch.Tensor, pair: AdapterPair) -> torch.Tensor:
    """A row-parallel weight's adapter term of this rank's input columns ``x``: the whole
    output, the same on every rank (added after the weight's partial sums are summed)."""
    tp = model.groups.tp
    x = _dropped(model, x, tp, model.groups.coords.tp_rank)
    z = reduce_from_tp(x @ model.param(pair.a.name).T, model.groups.tp_group)
    return z @ model.param(pair.b.name).T * _scale(model)


def _dropped(model: ShardedModel, x: torch.Tensor, parts: int, part: int) -> torch.Tensor:
    """``x`` as the adapter reads it: in a train pass with dropout, its ``part`` of ``parts``
    column blocks of a mask drawn for the whole input, kept elements scaled up."""
    assert model.spec.lora is not None
    p = model.spec.lora.dropout
    if p == 0 or not (model.training and torch.is_grad_enabled()):
        return x
    n = x.shape[-1]
    keep = torch.rand(*x.shape[:-1], n * parts, device=x.device) >= p
    return x * keep[..., part * n : (part + 1) * n] / (1 - p)


def _scale(model: ShardedModel) -> float:
    assert model.spec.lora is not None
    return model.spec.lora.scale


@contextlib.contextmanager
def dropout_seeded(model: ShardedModel, seed: int, step: int, replica: int) -> Iterator[None]:
    """For a train call of ``model`` with adapter dropout: torch's generator seeded by the run's
    ``seed``, the ``step`` and the ``replica`` (the ranks of a tp group draw the same masks, a
    run draws the same ones again), then restored. Without dropout, the generator untouched."""
    if model.spec.lora is None or model.spec.lora.dropout == 0:
        yield
        return
    device = model.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(hash((seed, step, replica)) % 2**63)
        yield
