"""Attention over packed tokens, with an optional KV cache, for the sharded model.

Tokens stay packed (``[n_tokens, ...]``, no padding) through every linear layer and norm; only
attention needs rows, so it scatters queries and keys into ``[rows, slots, heads, head_dim]``
buffers, runs scaled-dot-product attention with a causal (and sliding-window) mask, and gathers
the outputs back. A token's key slot is its position in its row, so a KV cache is the same
buffer kept across calls: prefill writes positions ``0..len-1``, each decode step one more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class TokenLayout:
    """Where each packed token sits: its row, its position in the row, its query slot."""

    rows: torch.Tensor  # [n] long
    positions: torch.Tensor  # [n] long
    slots: torch.Tensor  # [n] long, index among the row's tokens in this call
    n_rows: int
    n_slots: int  # max tokens of one row in this call
    n_keys: int  # key slots per row (cache capacity or longest row)

    @staticmethod
    def packed(lengths: list[int], start: list[int] | None = None) -> TokenLayout:
        """Rows of ``lengths`` tokens whose first token is at position ``start`` (default 0)."""
        start = start or [0] * len(lengths)
        rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        slots = torch.cat([torch.arange(n) for n in lengths]) if lengths else rows
        positions = slots + torch.tensor(start, dtype=torch.long)[rows]
        n_keys = max((s + n for s, n in zip(start, lengths, strict=True)), default=0)
        return TokenLayout(rows, positions, slots, len(lengths), max(lengths, default=0), n_keys)

    def to(self, device: torch.device) -> TokenLayout:
        if self.rows.device == device:
            return self
        rows, positions, slots = (t.to(device) for t in (self.rows, self.positions, self.slots))
        return TokenLayout(rows, positions, slots, self.n_rows, self.n_slots, self.n_keys)


class KVCache:
    """Keys and values of this rank's layers (its stage, its tp heads), each
    ``[rows, slots, heads, dim]``."""

    def __init__(self, n_rows: int, capacity: int, n_kv_heads: int, head_dim: int) -> None:
        self.shape = (n_rows, capacity, n_kv_heads, head_dim)
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, where: TokenLayout):
        if layer not in self.k:
            self.k[layer] = k.new_zeros(self.shape)
            self.v[layer] = v.new_zeros(self.shape)
        self.k[layer][where.rows, where.positions] = k
        self.v[layer][where.rows, where.positions] = v
        return self.k[layer], self.v[layer]


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: tuple[float, ...], scale: float = 1.0
) -> torch.Tensor:
    """Rotary embedding of ``x [n, heads, dim]`` (the half-split layout Hugging Face uses), at
    the model's frequencies (``ModelSpec.rope_inv_freq``: plain or scaled, e.g. Llama 3's) with
    cos and sin times ``scale`` (YaRN's attention factor; 1 otherwise). With fewer frequencies
    than half of ``dim``, the first dims rotate and the rest pass unchanged (partial RoPE)."""
    dim = x.shape[-1]
    if 2 * len(inv_freq) < dim:
        rotary = 2 * len(inv_freq)
        return torch.cat([rope(x[..., :rotary], positions, inv_freq, scale), x[..., rotary:]], -1)
    freqs = positions.float()[:, None] * torch.tensor(inv_freq, device=x.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    where: TokenLayout,
    window: int | None,
    cache: KVCache | None,
    layer: int,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed ``q [n, hq, d]`` over keys ``k, v [n, hkv, d]`` (+ cache),
    scores times ``scale`` (default ``d ** -0.5``) and soft-capped to ``(-softcap, softcap)``
    by ``tanh`` (Gemma 2) when given."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if cache is not None:
        keys, values = cache.store(layer, k, v, where)
    else:
        shape = (where.n_rows, where.n_keys, n_kv, k.shape[-1])
        index = (where.rows, where.positions)
        keys = k.new_zeros(shape).index_put(index, k)
        values = v.new_zeros(shape).index_put(index, v)
    queries = q.new_zeros(where.n_rows, where.n_slots, n_heads, q.shape[-1])
    queries = queries.index_put((where.rows, where.slots), q)
    # Query slots no token fills look at key 0 only (every row has one); their output is dropped.
    qpos = torch.zeros(where.n_rows, where.n_slots, dtype=torch.long, device=q.device)
    qpos[where.rows, where.slots] = where.positions
    key_pos = torch.arange(keys.shape[1], device=q.device)
    allowed = key_pos[None, None, :] <= qpos[:, :, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > qpos[:, :, None] - window
    if n_kv != n_heads:
        keys = keys.repeat_interleave(n_heads // n_kv, dim=2)
        values = values.repeat_interleave(n_heads // n_kv, dim=2)
    queries, keys, values = (t.transpose(1, 2) for t in (queries, keys, values))
    if softcap is None:
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed[:, None], scale=scale
        )
    else:  # as Hugging Face's eager attention: cap, mask, softmax in fp32
        scores = queries @ keys.transpose(2, 3) * (scale or q.shape[-1] ** -0.5)
        scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = scores.softmax(-1, dtype=torch.float32).to(values.dtype) @ values
    return out.transpose(1, 2)[where.rows, where.slots]
