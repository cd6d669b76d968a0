"""Helpers between packed sequences and the padded tensors a model forward needs.

They build padded inputs, find the position that scores each response token, gather per-position
outputs and pack padded rows back.

A sample's ``seq`` is prompt + response ids; ``prompt_lens`` holds one length per sample.
Per-response-token keys (logprobs, values, advantages) hold one row per response token. The
output at position ``p`` predicts token ``p + 1``, so response token ``j`` of a sample with
prompt length ``P`` is scored by position ``P - 1 + j``.
"""

from __future__ import annotations

import torch

from rayhf.data.batch import PackedBatch


def padded_inputs(batch: PackedBatch, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` (long) from ``seq``."""
    ids, mask = batch.to_padded("seq", pad_id)
    return ids.long(), mask.long()


def response_index(
    batch: PackedBatch, trained_only: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [B, R], mask [B, R])``: the position that scores each response token; with
    a ``loss_mask`` key (one flag per response token: a multi-turn call's model tokens) the mask
    keeps only the flagged tokens, unless not ``trained_only``. Per-response-token keys keep
    one entry per response token either way (0 where a token is not trained)."""
    prompt_lens = batch.tensors["prompt_lens"].long()
    seq_lens = torch.tensor(batch.seqlens["seq"], dtype=torch.long)
    resp_lens = seq_lens - prompt_lens
    width = int(resp_lens.max().item()) if len(resp_lens) else 0
    j = torch.arange(width).unsqueeze(0)
    mask = j < resp_lens.unsqueeze(1)
    if trained_only and "loss_mask" in batch.tensors:
        flags = batch.to_padded("loss_mask", 0)[0].bool()
        assert flags.shape == mask.shape, "loss_mask: one flag per response token"
        mask = mask & flags
    positions = (prompt_lens.unsqueeze(1) - 1 + j).clamp(max=max(int(seq_lens.max()) - 1, 0))
    return torch.where(mask, positions, torch.zeros_like(positions)), mask


def response_lengths(batch: PackedBatch) -> list[int]:
    prompt_lens = batch.tensors["prompt_lens"].tolist()
    return [s - p for s, p in zip(batch.seqlens["seq"], prompt_lens, strict=True)]


def gather_positions(per_position: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``per_position[b, positions[b, j], ...]`` for every ``b, j``."""
    index = positions
    for _ in range(per_position.dim() - 2):
        index = index.unsqueeze(-1)
    index = index.expand(*positions.shape, *per_position.shape[2:])
    return per_position.gather(1, index)


def response_labels(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The response token ids ``[B, R]`` (the token after each scoring position)."""
    return input_ids.gather(1, (positions + 1).clamp(max=input_ids.shape[1] - 1))


def pack_rows(padded: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The valid entries of each row concatenated, and the row lengths."""
    lengths = mask.sum(dim=1).tolist()
    return padded[mask], lengths


def pack_per_token(batch: PackedBatch, values: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``values`` ``[B, R]`` packed as a per-response-token key holds them: an entry for every
    response token of ``batch``, trained or not (a multi-turn sample's environment tokens too)."""
    return pack_rows(values, response_index(batch, trained_only=False)[1])


def informative_groups(scores: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Per sample: whether the scores of its group are not all equal (a group of one never
    is), the groups dynamic sampling keeps."""
    _, group = torch.unique(group_ids, return_inverse=True)
    n = int(group.max()) + 1 if group.numel() else 0
    x = scores.float()
    high = torch.full((n,), -torch.inf).scatter_reduce(0, group, x, "amax")
    low = torch.full((n,), torch.inf).scatter_reduce(0, group, x, "amin")
    return (high > low)[group]
