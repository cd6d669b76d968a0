"""Attention over packed tokens, with an optional KV cache, for the sharded model.

Tokens stay packed (``[n_tokens, ...]``, no padding) through every linear layer and norm; only
attention needs rows. A training forward or a prefill scatters queries and keys into
``[rows, heads, slots, head_dim]`` buffers and runs scaled-dot-product attention with a causal
(and sliding-window) mask over the keys of its longest row. A token's key slot is its position in
its row, so a KV cache is the same buffer kept across calls: a prefill writes positions
``0..len-1``, each decode step one more.

A decode step (``TokenLayout.decode``: one token per row, row ``i`` in cache row ``i``) attends
with ``decode_attention``: the query heads of a group share their key/value head through a
grouped matmul (no repeated keys), over the first ``n_keys`` slots of the cache only; shapes are
fixed for a given (rows, n_keys), so the step compiles and captures.
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
    n_keys: int  # key slots per row a query may see (longest row, or a decode step's bound)
    cache_rows: torch.Tensor | None = None  # [n_rows] the cache row of each row (None: itself)
    decode: bool = False  # one token per row, row i at index i (``decode_attention``)
    # decode: 0 for the keys each row sees, -inf past its position, [rows * kv heads, 1, n_keys],
    # fp32
    key_bias: torch.Tensor | None = None
    write_at: torch.Tensor | None = None  # decode: [rows * kv heads] each row's slot, flattened
    # every row starts at position 0 (a query's slot is its key's): a causal mask is the rows'
    from_start: bool = False
    square: bool = False  # from_start, and every row as long: the tokens are the rows, in order
    # context parallelism: the tokens this rank holds (the layers see these; attention sees
    # every token, after ``rayhf.parallel.context.to_heads``); None: all of them
    local: slice | None = None

    @staticmethod
    def packed(
        lengths: list[int],
        start: list[int] | None = None,
        cache_rows: list[int] | None = None,
        local: slice | None = None,
    ) -> TokenLayout:
        """Rows of ``lengths`` tokens whose first token is at position ``start`` (default 0),
        kept in cache rows ``cache_rows`` (default: row i in cache row i), this rank holding
        the ``local`` ones (context parallelism; default: all)."""
        start = start or [0] * len(lengths)
        rows = torch.repeat_interleave(
            torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long)
        )
        slots = torch.cat([torch.arange(n) for n in lengths]) if lengths else rows
        positions = slots + torch.tensor(start, dtype=torch.long)[rows]
        n_keys = max((s + n for s, n in zip(start, lengths, strict=True)), default=0)
        cache = None if cache_rows is None else torch.tensor(cache_rows, dtype=torch.long)
        from_start = not any(start)
        square = from_start and len(set(lengths)) == 1
        return TokenLayout(
            rows, positions, slots, len(lengths), max(lengths, default=0), n_keys, cache,
            from_start=from_start, square=square, local=local,
        )  # fmt: skip

    @staticmethod
    def decode_step(positions: torch.Tensor, n_keys: int, cache: KVCache) -> TokenLayout:
        """One token per row of cache rows ``0..len(positions)-1``, at ``positions`` (on the
        device already), seeing the first ``n_keys`` key slots; what every layer's attention
        needs of them is computed here, once a step."""
        n, device = len(positions), positions.device
        rows = torch.arange(n, device=device)
        heads = cache.shape[1]
        blocked = torch.arange(n_keys, device=device)[None, :] > positions[:, None]
        bias = torch.zeros(blocked.shape, device=device)  # fp32, as the scores are
        bias = bias.masked_fill_(blocked, float("-inf")).repeat_interleave(heads, 0)[:, None, :]
        head_rows = rows[:, None] * heads + torch.arange(heads, device=device)[None, :]
        write_at = (head_rows * cache.capacity + positions[:, None]).flatten()
        return TokenLayout(rows, positions, rows, n, 1, n_keys, None, True, bias, write_at)

    @property
    def local_positions(self) -> torch.Tensor:
        """The positions of the tokens this rank holds."""
        return self.positions if self.local is None else self.positions[self.local]

    def to(self, device: torch.device) -> TokenLayout:
        if self.rows.device == device:
            return self
        rows, positions, slots = (t.to(device) for t in (self.rows, self.positions, self.slots))
        cache_rows = None if self.cache_rows is None else self.cache_rows.to(device)
        assert not self.decode, "a decode step's layout is made on its device"
        return TokenLayout(
            rows, positions, slots, self.n_rows, self.n_slots, self.n_keys, cache_rows,
            from_start=self.from_start, square=self.square, local=self.local,
        )  # fmt: skip


class KVCache:
    """Keys and values of this rank's layers (its stage, its tp heads), each
    ``[rows, heads, capacity, dim]``, allocated once; a generator reuses it while it fits."""

    def __init__(
        self,
        layers: list[int] | range,
        n_rows: int,
        capacity: int,
        n_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = (n_rows, n_kv_heads, capacity, head_dim)
        self.dtype = dtype
        self.k = {i: torch.zeros(self.shape, dtype=dtype, device=device) for i in layers}
        self.v = {i: torch.zeros(self.shape, dtype=dtype, device=device) for i in layers}
        self.device = device
        # Gated DeltaNet layers (``hold_states``): per row, the recurrent state [heads, key
        # dim, value dim] (fp32) and the convolution's last inputs [channels, kernel - 1]
        self.state: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}

    def hold_states(
        self, layers: list[int], state: tuple[int, int, int], channels: int, history: int
    ) -> None:
        """Room for each row's state in recurrent ``layers``: ``state`` per row and
        ``channels x history`` convolution inputs."""
        rows = self.n_rows
        for i in layers:
            self.state[i] = torch.zeros(rows, *state, device=self.device)
            self.conv[i] = torch.zeros(
                rows, channels, history, dtype=self.dtype, device=self.device
            )

    @property
    def n_rows(self) -> int:
        return self.shape[0]

    @property
    def capacity(self) -> int:
        return self.shape[2]

    def fits(self, n_rows: int, capacity: int) -> bool:
        return n_rows <= self.n_rows and capacity <= self.capacity

    def nbytes(self) -> int:
        held = (*self.k.values(), *self.v.values(), *self.state.values(), *self.conv.values())
        return sum(t.numel() * t.element_size() for t in held)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, where: TokenLayout):
        """Write packed ``k, v [n, heads, dim]`` at their rows' positions; returns the keys and
        values each row of the call sees, ``[n_rows, heads, n_keys, dim]``. They are kept in
        the cache's dtype (q/k-normed keys of fp32 master weights under autocast are fp32)."""
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)
        if where.write_at is not None:  # a decode step: each row's slot, per head, flattened
            dim = self.shape[-1]
            self.k[layer].view(-1, dim).index_copy_(0, where.write_at, k.reshape(-1, dim))
            self.v[layer].view(-1, dim).index_copy_(0, where.write_at, v.reshape(-1, dim))
        else:
            rows = where.rows if where.cache_rows is None else where.cache_rows[where.rows]
            self.k[layer][rows, :, where.positions] = k
            self.v[layer][rows, :, where.positions] = v
        if where.cache_rows is None:
            keep = slice(0, where.n_rows)
            return self.k[layer][keep, :, : where.n_keys], self.v[layer][keep, :, : where.n_keys]
        return (
            self.k[layer][where.cache_rows, :, : where.n_keys],
            self.v[layer][where.cache_rows, :, : where.n_keys],
        )

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, n_slots: int) -> None:
        """Cache rows ``dst`` get the first ``n_slots`` keys and values of rows ``src``, and
        their recurrent states whole."""
        for cache in (self.k, self.v):
            for t in cache.values():
                t[dst, :, :n_slots] = t[src, :, :n_slots]
        for states in (self.state, self.conv):
            for t in states.values():
                t[dst] = t[src]


def rotary(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and signed sin ``[n, 1, 2 * len(inv_freq)]`` of ``positions`` at the model's
    frequencies (``ModelSpec.rope_inv_freq``: plain or scaled, e.g. Llama 3's), times ``scale``
    (YaRN's attention factor; 1 otherwise). The sin's first half is negated, so a rotation is
    ``x * cos + roll(x, half) * sin``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos() * scale, freqs.sin() * scale
    return torch.cat([cos, cos], -1)[:, None, :], torch.cat([-sin, sin], -1)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [n, heads, dim]`` (the half-split layout Hugging Face uses), the tables cast
    to ``x``'s dtype. With a table narrower than ``dim``, the first dims rotate and the rest pass
    unchanged (partial RoPE)."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned = apply_rotary(x[..., :rotary_dim], cos, sin)
        return torch.cat([turned, x[..., rotary_dim:]], -1)
    return x * cos + x.roll(rotary_dim // 2, -1) * sin


def rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: tuple[float, ...], scale: float = 1.0
) -> torch.Tensor:
    """``apply_rotary`` of ``x [n, heads, dim]`` at ``positions`` (one-off; a model computes
    the tables once per forward)."""
    freq = torch.tensor(inv_freq, device=x.device)
    return apply_rotary(x, *rotary(positions, freq, scale))


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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed ``q [n, hq, d]`` over keys ``k, v [n, hkv, d]`` (+ cache),
    scores times ``scale`` (default ``d ** -0.5``) and soft-capped to ``(-softcap, softcap)``
    by ``tanh`` (Gemma 2) when given; ``sinks [hq]``: a logit per head beside its keys' in the
    softmax, whose weight is dropped (gpt-oss)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if cache is not None:
        keys, values = cache.store(layer, k, v, where)
        if where.decode:
            assert where.key_bias is not None
            bias = where.key_bias
            if window is not None:
                key_pos = torch.arange(where.n_keys, device=q.device)
                early = key_pos[None, :] <= where.positions[:, None] - window
                early = early.repeat_interleave(keys.shape[1], 0)[:, None, :]
                bias = bias.masked_fill(early, float("-inf"))
            return decode_attention(q, keys, values, bias, scale, softcap, sinks)
    else:
        shape = (where.n_rows, where.n_keys, n_kv, k.shape[-1])
        keys, values = (_rows(t, where, shape, where.positions) for t in (k, v))
    queries = _rows(q, where, (where.n_rows, where.n_slots, n_heads, q.shape[-1]), where.slots)
    plain = softcap is None and sinks is None
    if plain and window is None and cache is None and where.from_start:
        # keys past a query's position are the only ones to hide: the causal kernel's mask
        keys, values = _grouped_keys(keys, values, n_heads)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
        return _tokens(out, where)
    # Query slots no token fills look at key 0 only (every row has one); their output is dropped.
    qpos = torch.zeros(where.n_rows, where.n_slots, dtype=torch.long, device=q.device)
    qpos[where.rows, where.slots] = where.positions
    key_pos = torch.arange(keys.shape[2], device=q.device)
    allowed = key_pos[None, None, :] <= qpos[:, :, None]
    if window is not None:
        allowed &= key_pos[None, None, :] > qpos[:, :, None] - window
    keys, values = _grouped_keys(keys, values, n_heads)
    if plain:
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=allowed[:, None], scale=scale
        )
    else:  # as Hugging Face's eager attention: cap, mask, (sink), softmax in fp32
        scores = queries @ keys.transpose(2, 3) * (scale or q.shape[-1] ** -0.5)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        probs = _with_sinks(scores.float(), sinks).softmax(-1)
        out = probs[..., : scores.shape[-1]].to(values.dtype) @ values
    return _tokens(out, where)


def by_rows(
    x: torch.Tensor, where: TokenLayout, n_slots: int | None = None, at: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed ``x [n, ...]`` as rows ``[rows, n_slots, ...]`` (default: the call's slots), each
    token at slot ``at`` of its row (default: its own slot), zeros where a row has no token: a
    view when the tokens are the rows already."""
    if where.square:
        return x.reshape(where.n_rows, -1, *x.shape[1:])
    n_slots = where.n_slots if n_slots is None else n_slots
    at = where.slots if at is None else at
    return x.new_zeros((where.n_rows, n_slots, *x.shape[1:])).index_put((where.rows, at), x)


def by_tokens(x: torch.Tensor, where: TokenLayout) -> torch.Tensor:
    """Rows ``[rows, slots, ...]`` back to packed ``[n, ...]``."""
    if where.square:
        return x.reshape(-1, *x.shape[2:])
    return x[where.rows, where.slots]


def _rows(
    t: torch.Tensor, where: TokenLayout, shape: tuple[int, ...], at: torch.Tensor
) -> torch.Tensor:
    """Packed ``t [n, heads, d]`` as attention's rows ``[rows, heads, slots, d]`` (``shape``
    before the transpose), each token at slot ``at`` of its row (``by_rows``)."""
    return by_rows(t, where, shape[1], at).transpose(1, 2)


def _tokens(out: torch.Tensor, where: TokenLayout) -> torch.Tensor:
    """Attention's ``out [rows, heads, slots, d]`` back to packed ``[n, heads, d]``."""
    return by_tokens(out.transpose(1, 2), where)


def _grouped_keys(
    keys: torch.Tensor, values: torch.Tensor, n_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key/value head repeated for the query heads of its group."""
    n_kv = keys.shape[1]
    if n_kv == n_heads:
        return keys, values
    repeat = n_heads // n_kv
    return keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_bias: torch.Tensor,
    scale: float | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row, ``q [rows, hq, d]``, over ``keys, values [rows, hkv, n_keys, d]``
    plus ``key_bias [rows * hkv, 1, n_keys]`` (-inf: a key past the row's position, outside its
    window): the ``hq / hkv`` query heads of a group are one matmul's rows against their shared
    key head. Scores and softmax in fp32 (as fused attention kernels keep them), the weights
    cast to the values' dtype for their matmul (``sinks``: see ``attention``)."""
    rows, n_heads, dim = q.shape
    n_kv = keys.shape[1]
    grouped = q.reshape(rows * n_kv, n_heads // n_kv, dim)
    keys_t = keys.flatten(0, 1).transpose(1, 2)  # [rows * hkv, d, n_keys], no copy
    scale = scale or dim**-0.5
    if softcap is None:
        scores = _fp32_scores(key_bias, grouped, keys_t, scale)
    else:
        scores = _fp32_scores(torch.zeros_like(key_bias), grouped, keys_t, scale)
        scores = torch.tanh(scores / softcap) * softcap + key_bias
    n_keys = scores.shape[-1]
    # (rows * hkv, hq / hkv) are (rows, hq) in head order: one query per row and head
    scores = _with_sinks(scores.view(rows, n_heads, 1, n_keys), sinks)
    probs = scores.softmax(-1)[..., :n_keys].view(rows * n_kv, n_heads // n_kv, n_keys)
    probs = probs if probs.dtype == values.dtype else probs.to(values.dtype)
    return torch.bmm(probs, values.flatten(0, 1)).view(rows, n_heads, dim)


def _with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``scores [rows, heads, queries, keys]`` with each head's sink logit as one more key."""
    if sinks is None:
        return scores
    column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1)


def _fp32_scores(
    bias: torch.Tensor, q: torch.Tensor, keys_t: torch.Tensor, scale: float
) -> torch.Tensor:
    """``bias + scale * q @ keys_t`` in fp32: one kernel whatever the inputs' dtype (on CUDA a
    bf16/fp16 matmul writes fp32; elsewhere the inputs are cast first)."""
    if q.dtype == torch.float32:
        return torch.baddbmm(bias, q, keys_t, alpha=scale)
    if q.is_cuda and _OUT_DTYPE:
        return torch.baddbmm(bias, q, keys_t, out_dtype=torch.float32, alpha=scale)
    return torch.baddbmm(bias, q.float(), keys_t.float(), alpha=scale)


# whether this torch has baddbmm's out_dtype overload (CUDA: bf16/fp16 in, fp32 out)
_OUT_DTYPE = hasattr(torch.ops.aten.baddbmm, "dtype")
