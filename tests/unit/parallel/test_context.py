"""Context parallelism's exchanges (``rayhf.parallel.context``): attention over rows split
between two gloo ranks equals one process's, forward and backward, with key/value heads that
split and that must be repeated first; the slices and the padding that make the split even."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayhf.parallel.attention import TokenLayout, attention
from rayhf.parallel.context import (
    attention_heads,
    gather_tokens,
    local_slice,
    padding,
    to_heads,
    to_tokens,
)

LENGTHS = [5, 3, 8]  # 16 tokens: 8 a rank, the middle row cut across the two
HEADS, DIM = 4, 8


def test_the_stream_pads_to_equal_slices_that_cover_it_in_order():
    assert [padding(n, 4) for n in (16, 17, 18, 19)] == [0, 3, 2, 1]
    slices = [local_slice(12, 3, r) for r in range(3)]
    assert [(s.start, s.stop) for s in slices] == [(0, 4), (4, 8), (8, 12)]


def _inputs(n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n_kv)
    n = sum(LENGTHS)
    q, k, v = (torch.randn(n, h, DIM, generator=gen) for h in (HEADS, n_kv, n_kv))
    return q, k, v, torch.randn(n, HEADS, DIM, generator=gen)  # and a gradient for the output


def _split(rank: int, path: str, n_kv: int, out: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        group = dist.group.WORLD
        mine = local_slice(sum(LENGTHS), 2, rank)
        q, k, v, grad = (t[mine].clone().requires_grad_(True) for t in _inputs(n_kv))
        where = TokenLayout.packed(LENGTHS, local=mine)
        heads = attention_heads(q, k, v, 2, group)
        y = to_tokens(attention(*heads, where, None, None, 0), 2, group)
        y.backward(grad)
        round_trip = to_tokens(to_heads(q.detach(), 2, group), 2, group)
        whole = gather_tokens(y.detach(), 2, rank, group)
        out[rank] = (y.detach(), q.grad, k.grad, v.grad, round_trip, whole)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n_kv", [2, 1])  # kv heads split over cp, and repeated first
def test_attention_over_a_split_sequence_is_one_process_s(tmp_path, n_kv):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_split, args=(str(tmp_path / "store"), n_kv, out), nprocs=2)
        got = dict(out)
    q, k, v, grad = (t.requires_grad_(True) for t in _inputs(n_kv))
    y = attention(q, k, v, TokenLayout.packed(LENGTHS), None, None, 0)
    y.backward(grad.detach())
    for rank in (0, 1):
        mine = local_slice(sum(LENGTHS), 2, rank)
        y_r, gq, gk, gv, round_trip, whole = got[rank]
        torch.testing.assert_close(y_r, y.detach()[mine], rtol=1e-5, atol=1e-6)
        for g, want in ((gq, q.grad), (gk, k.grad), (gv, v.grad)):
            assert want is not None
            torch.testing.assert_close(g, want[mine], rtol=1e-5, atol=1e-6)
        assert torch.equal(round_trip, q.detach()[mine])
        torch.testing.assert_close(whole, y.detach(), rtol=1e-5, atol=1e-6)
