"""LoRA adapters on a rank's shards (``rayhf.models.lora``): added beside the weights they adapt,
applied unmerged, with the autograd rules of the split they follow.

- column-parallel: ``(x A^T) B_local^T``, A read through ``copy_to_tp``: each rank's gradient
  of A covers only its output rows, so they are summed over tp (as a column-parallel layer's
  input gradient is). Where the weight is whole on every rank, nothing is summed.
- row-parallel: ``z = reduce_from_tp(x_local A_local^T)`` (the rank's columns' share of
  ``x A^T``, summed), then ``z B^T`` added after the weight's own sum: every rank computes the
  same ``z`` and the same gradient of B, and gets the gradient of its own columns of A.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rayhf.models.sharding import AdapterPair, adapter_pairs
from rayhf.parallel.tp import copy_to_tp, reduce_from_tp

if TYPE_CHECKING:
    from rayhf.parallel.model import ShardedModel


def adapters_of(model: ShardedModel) -> dict[str, AdapterPair]:
    """The adapter pairs of the weights ``model`` holds, by the weight's name."""
    return {pair.weight: pair for pair in adapter_pairs(model.spec, model.shards.values())}


def unreduced_term(model: ShardedModel, x: torch.Tensor, pair: AdapterPair) -> torch.Tensor:
    """A column-parallel or whole weight's adapter term of ``x``: this rank's output columns."""
    group = model.groups.tp_group if pair.split == "column" else None
    a = copy_to_tp(model.param(pair.a.name), group)
    return (x @ a.T) @ model.param(pair.b.name).T * _scale(model)


def reduced_term(model: ShardedModel, x: torch.Tensor, pair: AdapterPair) -> torch.Tensor:
    """A row-parallel weight's adapter term of this rank's input columns ``x``: the whole
    output, the same on every rank (added after the weight's partial sums are summed)."""
    z = reduce_from_tp(x @ model.param(pair.a.name).T, model.groups.tp_group)
    return z @ model.param(pair.b.name).T * _scale(model)


def _scale(model: ShardedModel) -> float:
    assert model.spec.lora is not None
    return model.spec.lora.scale
