"""Packed variable-length batches: the one batch format that crosses every call.

A batch holds N samples. Each key is one tensor that concatenates the samples' values along
dim 0 with no padding, and ``seqlens[key][i]`` says how many rows sample ``i`` owns. A per-sample
scalar (a reward score) is a key whose every seqlen is 1. Padding exists only inside a model
forward (``to_padded``), never in the batch that moves between role groups.

Besides tensors, a batch carries ``extras``: per-sample values that are not tokens (a dataset
row's ground truth, its data source), one list entry per sample, kept in step with the samples
through every select, split, concat and reorder, so a reward function receives its own row's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

SEQUENCE_KEYS = ("seq", "chosen", "rejected")  # the keys holding whole token sequences


@dataclass
class PackedBatch:
    """Samples concatenated per key; ``sample_ids`` keeps each sample's identity across splits."""

    sample_ids: list[int]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    seqlens: dict[str, list[int]] = field(default_factory=dict)
    extras: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, tensor in self.tensors.items():
            lens = self.seqlens[key]
            assert len(lens) == len(self.sample_ids), f"{key}: {len(lens)} seqlens"
            assert sum(lens) == tensor.shape[0], f"{key}: seqlens sum != rows"
        for key, values in self.extras.items():
            assert len(values) == len(self.sample_ids), f"{key}: {len(values)} extra values"

    @property
    def n_samples(self) -> int:
        return len(self.sample_ids)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def n_tokens(self, key: str) -> int:
        return sum(self.seqlens[key])

    def offsets(self, key: str) -> list[int]:
        """Start row of every sample in ``tensors[key]``, plus the total at the end."""
        out = [0]
        for n in self.seqlens[key]:
            out.append(out[-1] + n)
        return out

    def sample(self, key: str, i: int) -> torch.Tensor:
        off = self.offsets(key)
        return self.tensors[key][off[i] : off[i + 1]]

    def add(self, key: str, tensor: torch.Tensor, seqlens: list[int]) -> None:
        self.tensors[key] = tensor
        self.seqlens[key] = list(seqlens)
        self.__post_init__()

    def add_extra(self, key: str, values: list[Any]) -> None:
        self.extras[key] = list(values)
        self.__post_init__()

    def update(self, other: PackedBatch) -> None:
        """Take every key and extra of ``other``, whose samples must be ours in the same order."""
        assert other.sample_ids == self.sample_ids, "update needs the same samples in order"
        for key in other.tensors:
            self.add(key, other.tensors[key], other.seqlens[key])
        for key, values in other.extras.items():
            self.add_extra(key, values)

    def select(self, indices: list[int], keys: list[str] | None = None) -> PackedBatch:
        """The samples at ``indices`` (in that order), restricted to ``keys`` if given."""
        keys = self.keys() if keys is None else keys
        tensors, seqlens = {}, {}
        for key in keys:
            off = self.offsets(key)
            parts = [self.tensors[key][off[i] : off[i + 1]] for i in indices]
            tensors[key] = torch.cat(parts) if parts else self.tensors[key][:0]
            seqlens[key] = [self.seqlens[key][i] for i in indices]
        extras = {key: [values[i] for i in indices] for key, values in self.extras.items()}
        return PackedBatch([self.sample_ids[i] for i in indices], tensors, seqlens, extras)

    def split(self, n_parts: int, by_key: str | None = None) -> list[PackedBatch]:
        """Split into ``n_parts`` batches balanced by token count of ``by_key``."""
        key = by_key or (self.keys()[0] if self.tensors else None)
        costs = self.seqlens[key] if key else [1] * self.n_samples
        groups = balanced_partition(costs, n_parts)
        return [self.select(sorted(g)) for g in groups]

    def minibatches(self, n_minibatches: int, by_key: str | None = None) -> list[PackedBatch]:
        """Like ``split`` but never returns an empty part (fewer parts when samples run out)."""
        parts = self.split(min(n_minibatches, max(self.n_samples, 1)), by_key)
        return [p for p in parts if p.n_samples > 0]

    def sequence_tokens(self) -> list[int]:
        """Each sample's tokens over its token sequences (``seq``; ``chosen`` + ``rejected``)."""
        keys = [k for k in SEQUENCE_KEYS if k in self.seqlens]
        return [sum(self.seqlens[k][i] for k in keys) for i in range(self.n_samples)]

    def token_chunks(self, budget: int) -> list[PackedBatch]:
        """Consecutive runs of samples holding at most ``budget`` sequence tokens each (a
        micro-batch cut by a token budget); ``concat`` of the chunks is this batch again."""
        chunks: list[list[int]] = []
        load = budget  # start a new chunk with the first sample
        for i, n in enumerate(self.sequence_tokens()):
            if n > budget:
                raise ValueError(f"a {n}-token sample is over the {budget}-token budget")
            if load + n > budget:
                chunks.append([])
                load = 0
            chunks[-1].append(i)
            load += n
        return [self.select(c) for c in chunks] or [self]

    @staticmethod
    def concat(batches: list[PackedBatch]) -> PackedBatch:
        """Join batches that hold the same keys (the inverse of ``split`` up to order)."""
        assert batches, "concat of no batches"
        keys = batches[0].keys()
        ids = [i for b in batches for i in b.sample_ids]
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in keys}
        seqlens = {k: [n for b in batches for n in b.seqlens[k]] for k in keys}
        extras = {k: [v for b in batches for v in b.extras[k]] for k in batches[0].extras}
        return PackedBatch(ids, tensors, seqlens, extras)

    def reorder(self, sample_ids: list[int]) -> PackedBatch:
        """The same batch with samples in the order of ``sample_ids``."""
        where = {sid: i for i, sid in enumerate(self.sample_ids)}
        return self.select([where[sid] for sid in sample_ids])

    def to_padded(self, key: str, pad_value: float | int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``[N, max_len, ...]`` tensor of ``key`` and its boolean mask."""
        lens = self.seqlens[key]
        src = self.tensors[key]
        max_len = max(lens, default=0)
        out = src.new_full((len(lens), max_len, *src.shape[1:]), pad_value)
        mask = torch.zeros(len(lens), max_len, dtype=torch.bool)
        off = self.offsets(key)
        for i, n in enumerate(lens):
            out[i, :n] = src[off[i] : off[i + 1]]
            mask[i, :n] = True
        return out, mask


def balanced_partition(costs: list[int], n_parts: int) -> list[list[int]]:
    """Indices of ``costs`` in ``n_parts`` groups with near-equal total cost.

    Greedy longest-processing-time: the largest remaining item goes to the lightest group, so the
    heaviest group exceeds the mean by at most the largest single item. Ties in group load go to
    the group with fewer items, so equal costs split evenly by count too.
    """
    assert n_parts >= 1, "n_parts must be positive"
    groups: list[list[int]] = [[] for _ in range(n_parts)]
    loads = [0] * n_parts
    for i in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
        g = min(range(n_parts), key=lambda k: (loads[k], len(groups[k]), k))
        groups[g].append(i)
        loads[g] += costs[i]
    return groups
