"""The pipeline on one stage (pp = 1): micro-batch row ranges by hand, and forward, cached step
and broadcast reducing to the stage's own model."""

from __future__ import annotations

import pytest
import torch

from rayhf.checks.common import VOCAB, tiny_model
from rayhf.models.spec import model_spec
from rayhf.parallel.attention import TokenLayout
from rayhf.parallel.groups import single
from rayhf.parallel.model import ShardedModel
from rayhf.parallel.pipeline import Pipeline, split_rows, split_tokens


@pytest.mark.parametrize(
    ("n_rows", "n_microbatches", "sizes"),
    [
        (6, 3, [2, 2, 2]),
        (7, 3, [3, 2, 2]),  # the first micro-batches take the remainder
        (2, 4, [1, 1]),  # never an empty micro-batch
        (5, 1, [5]),
        (0, 2, [0]),
    ],
)
def test_split_rows_is_contiguous_and_balanced(n_rows, n_microbatches, sizes):
    parts = split_rows(n_rows, n_microbatches)
    assert [len(p) for p in parts] == sizes
    assert [r for p in parts for r in p] == list(range(n_rows))


@pytest.mark.parametrize(
    ("lengths", "n_microbatches", "sizes"),
    [
        ([8, 1, 1, 1, 1, 1, 1, 1, 1], 2, [1, 8]),  # a long row alone: 8 tokens each
        ([1, 1, 1, 1, 12], 2, [4, 1]),  # never an empty micro-batch, however long the last
        ([3] * 6, 3, [2, 2, 2]),
        ([2, 2], 4, [1, 1]),
        ([], 2, [0]),
    ],
)
def test_split_tokens_is_contiguous_and_balances_tokens(lengths, n_microbatches, sizes):
    parts = split_tokens(lengths, n_microbatches)
    assert [len(p) for p in parts] == sizes
    assert [r for p in parts for r in p] == list(range(len(lengths)))
    exact = split_tokens(lengths[:1], 3, exact=True)  # an ep group's ranks: as many, some empty
    assert len(exact) == 3 and [r for p in exact for r in p] == list(range(len(lengths[:1])))


def _pipe(value_head: bool = False, n_microbatches: int = 2) -> Pipeline:
    hf = tiny_model("llama", {"n_heads": 4}, value_head)
    model = ShardedModel(model_spec(hf.config, value_head), single(), hf.state_dict())
    return Pipeline(model, single(), n_microbatches)


def test_one_stage_has_no_neighbours():
    pipe = _pipe()
    assert (pipe.prev, pipe.next, pipe.last) == (None, None, 0)
    assert pipe.out_shape(5) == (5, VOCAB)
    assert _pipe(value_head=True).out_shape(5) == (5,)


def test_forward_is_the_stage_s_model_and_records_nothing():
    pipe = _pipe(n_microbatches=3)
    lengths = [3, 4, 2]
    ids = torch.randint(3, VOCAB, (sum(lengths),), generator=torch.Generator().manual_seed(0))
    pipe.record = True
    out = pipe.forward(ids, lengths)
    torch.testing.assert_close(out, pipe.model(ids, TokenLayout.packed(lengths)))
    assert pipe.pending == []  # one stage: autograd alone carries the backward
    pipe.backward_pending()  # nothing to do


def test_step_prefills_then_decodes_with_the_cache():
    pipe = _pipe()
    prompts = [[3, 4, 5], [6, 7]]
    cache = pipe.model.new_cache(2, 8)
    ids = torch.tensor([t for p in prompts for t in p])
    with torch.no_grad():
        logits = pipe.step(ids, TokenLayout.packed([3, 2]), cache, torch.tensor([2, 4]))
        nxt = torch.tensor([8, 9])
        decoded = pipe.step(nxt, TokenLayout.packed([1, 1], start=[3, 2]), cache, torch.arange(2))
        full = pipe.forward(torch.tensor([3, 4, 5, 8, 6, 7, 9]), [4, 3])
    torch.testing.assert_close(logits, full[[2, 5]], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(decoded, full[[3, 6]], rtol=1e-5, atol=1e-5)


def test_broadcast_on_one_stage_is_the_identity():
    t = torch.arange(4.0)
    assert _pipe().broadcast(t) is t
