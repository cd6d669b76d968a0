"""Packed sequences <-> padded model inputs, worked by hand on three samples: two responses of
different lengths and one sample that is all prompt."""

import torch

from rayhf.algorithms.seqs import (
    gather_positions,
    pack_rows,
    padded_inputs,
    response_index,
    response_labels,
    response_lengths,
)
from rayhf.data.batch import PackedBatch

SEQS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
PROMPT_LENS = [2, 1, 3]  # responses [7, 8], [10], []


def _batch() -> PackedBatch:
    b = PackedBatch([3, 1, 2])
    b.add("seq", torch.tensor([t for s in SEQS for t in s], dtype=torch.int32), [4, 2, 3])
    b.add("prompt_lens", torch.tensor(PROMPT_LENS, dtype=torch.int32), [1, 1, 1])
    return b


def test_padded_inputs_are_right_padded_longs():
    ids, mask = padded_inputs(_batch(), pad_id=99)
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 99, 99], [11, 12, 13, 99]]
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]


def test_response_index_points_at_the_position_before_each_response_token():
    positions, mask = response_index(_batch())
    # response token j of a sample with prompt length P is scored by position P - 1 + j;
    # padding points at position 0 so a gather stays in range
    assert positions.tolist() == [[1, 2], [0, 0], [0, 0]]
    assert mask.tolist() == [[True, True], [True, False], [False, False]]
    assert response_lengths(_batch()) == [2, 1, 0]


def test_response_labels_are_the_tokens_after_the_scoring_positions():
    ids, _ = padded_inputs(_batch(), pad_id=0)
    positions, mask = response_index(_batch())
    labels = response_labels(ids, positions)
    assert labels[mask].tolist() == [7, 8, 10]
    # the last column's position is clamped into the row, whatever the mask says
    assert response_labels(ids, torch.tensor([[3]] * 3)).tolist() == [[8], [0], [0]]


def test_gather_positions_of_per_token_values_and_logits():
    positions = torch.tensor([[1, 2], [0, 0]])
    values = torch.tensor([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0]])
    assert gather_positions(values, positions).tolist() == [[11.0, 12.0], [20.0, 20.0]]
    logits = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    got = gather_positions(logits, positions)
    assert got.shape == (2, 2, 4)
    assert torch.equal(got[0], logits[0, [1, 2]]) and torch.equal(got[1], logits[1, [0, 0]])


def test_pack_rows_keeps_valid_entries_in_row_order():
    padded = torch.tensor([[1.0, 2.0], [3.0, -9.0], [-9.0, -9.0]])
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    packed, lengths = pack_rows(padded, mask)
    assert packed.tolist() == [1.0, 2.0, 3.0] and lengths == [2, 1, 0]
    # and back: the packed rows are a PackedBatch key whose to_padded gives the rows again
    b = PackedBatch([0, 1, 2])
    b.add("x", packed, lengths)
    again, again_mask = b.to_padded("x", -9.0)
    assert torch.equal(again, padded) and torch.equal(again_mask, mask)
