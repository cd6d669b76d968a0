"""Attention over packed tokens against a plain per-row reference: token layouts by hand, rotary
embedding against its formula, causal / sliding-window / grouped-query attention, and a KV cache
that decodes what a full forward computes."""

from __future__ import annotations

import math

import pytest
import torch

from rayhf.parallel.attention import KVCache, TokenLayout, attention, rope

D = 8  # head dim


def test_packed_layout_by_hand():
    where = TokenLayout.packed([2, 3], start=[4, 0])
    assert where.rows.tolist() == [0, 0, 1, 1, 1]
    assert where.slots.tolist() == [0, 1, 0, 1, 2]
    assert where.positions.tolist() == [4, 5, 0, 1, 2]
    assert (where.n_rows, where.n_slots, where.n_keys) == (2, 3, 6)  # row 0 reaches key 5
    one = TokenLayout.packed([3])
    assert one.positions.tolist() == [0, 1, 2] and one.n_keys == 3
    assert one.to(torch.device("cpu")) is one


def test_rope_rotates_each_half_split_pair_by_position_times_frequency():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, D, generator=g, dtype=torch.float64)
    positions = torch.tensor([0, 5, 17])
    theta = 500.0
    out = rope(x, positions, tuple(theta ** (-2 * i / D) for i in range(D // 2)))
    half = D // 2
    expected = x.clone()
    for n, pos in enumerate(positions.tolist()):
        for i in range(half):
            angle = pos * theta ** (-2 * i / D)
            a, b = x[n, :, i], x[n, :, i + half]
            expected[n, :, i] = a * math.cos(angle) - b * math.sin(angle)
            expected[n, :, i + half] = b * math.cos(angle) + a * math.sin(angle)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)  # float32 frequencies
    torch.testing.assert_close(out[0], x[0])  # position 0 is not rotated
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))  # a rotation


def _reference(q, k, v, lengths, window=None):
    """Each row alone: softmax(q k^T / sqrt d) v over keys at or before the query (and within
    ``window``), kv heads repeated for their query heads, in float64."""
    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lengths:
        qr, kr, vr = (t[start : start + n].double() for t in (q, k, v))
        kr, vr = kr.repeat_interleave(group, 1), vr.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qr, kr) / math.sqrt(q.shape[-1])
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = j <= i if window is None else (j <= i) & (j > i - window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vr))
        start += n
    return torch.cat(outs).float()


def _qkv(n: int, heads: int, kv_heads: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, D, generator=g) for h in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(2, 2, None), (4, 2, None), (4, 1, 2)])
def test_packed_attention_is_causal_per_row(heads, kv_heads, window):
    lengths = [3, 1, 5]
    q, k, v = _qkv(sum(lengths), heads, kv_heads)
    out = attention(q, k, v, TokenLayout.packed(lengths), window, None, 0)
    assert out.shape == q.shape
    torch.testing.assert_close(out, _reference(q, k, v, lengths, window), rtol=1e-5, atol=1e-5)


def test_rows_do_not_see_each_other():
    lengths = [2, 3]
    q, k, v = _qkv(5, 2, 2)
    alone = attention(q[2:], k[2:], v[2:], TokenLayout.packed([3]), None, None, 0)
    k2 = k.clone()
    k2[:2] += 100.0  # another row's keys
    together = attention(q, k2, v, TokenLayout.packed(lengths), None, None, 0)
    torch.testing.assert_close(together[2:], alone)


@pytest.mark.parametrize("window", [None, 3])
def test_a_kv_cache_decodes_what_a_full_forward_computes(window):
    """Prefill two rows into cache rows 3 and 1, then decode two steps of both (one token per
    row, grouped-query heads, a key bound past the filled slots)."""
    lengths, extra = [3, 5], 2
    total = [n + extra for n in lengths]
    q, k, v = _qkv(sum(total), 4, 2, seed=3)
    full = attention(q, k, v, TokenLayout.packed(total), window, None, 0)
    rows = torch.repeat_interleave(torch.arange(2), torch.tensor(total))
    slot = torch.cat([torch.arange(n) for n in total])
    cache = KVCache([7], n_rows=4, capacity=max(total) + 2, n_kv_heads=2, head_dim=D)
    pick = [(rows == r) & (slot < n) for r, n in enumerate(lengths)]
    first = pick[0] | pick[1]
    prefill = TokenLayout.packed(lengths, cache_rows=[3, 1])
    out = attention(q[first], k[first], v[first], prefill, window, cache, 7)
    torch.testing.assert_close(out, full[first], rtol=1e-5, atol=1e-5)
    assert cache.k[7].shape == (4, 2, max(total) + 2, D)
    for step in range(extra):
        new = torch.stack([((rows == r) & (slot == n + step)) for r, n in enumerate(lengths)])
        idx = new.int().argmax(dim=1)  # the token of each row at this step
        # decode steps run over cache rows 0..n-1: move the two rows there first
        if step == 0:
            cache.copy_rows(torch.tensor([0, 1]), torch.tensor([3, 1]), max(total))
        positions = torch.tensor([n + step for n in lengths])
        where = TokenLayout.decode_step(positions, max(total) + 1, cache)
        out = attention(q[idx], k[idx], v[idx], where, window, cache, 7)
        torch.testing.assert_close(out, full[idx], rtol=1e-5, atol=1e-5)
