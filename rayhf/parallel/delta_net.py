"""Gated DeltaNet over packed rows (Qwen3.5's and Qwen3-Next's linear-attention layers).

Per token a layer projects q|k|v, mixes each channel with its last ``kernel - 1`` inputs (a
causal depthwise convolution, then SiLU), and runs the gated delta rule: a state ``S [key dim,
value dim]`` per value head, decayed by ``exp(g)`` and corrected towards the token's value,

    S <- exp(g) S;   S <- S + beta k (v - S^T k)^T;   out = S^T q

(q and k L2-normalized, q scaled by ``key_dim ** -0.5``). Training and prefills run it chunked
(``CHUNK`` tokens at a time: within a chunk as matrix products, the triangular system of the
chunk's corrections solved at once; across chunks the recurrence), one sequence per row: the
packed tokens are scattered into ``[rows, slots, ...]``, so every row starts from a zero state
and a zero convolution history, and nothing crosses a sequence boundary. Slots past a row's end
carry ``beta = 0`` and ``g = 0``: they change no state, so a row's final state is the one after
its last token. This is the torch form, written to give Hugging Face's torch path's numbers;
each operation runs in the dtype Hugging Face's runs it in, under the same autocast.

On a GPU with flash-linear-attention installed (``fla_kernel``), training and prefills run its
Triton kernel instead, over the packed tokens as they are (``packed_rule``: each sequence's
bounds from ``cu_seqlens``, so no scatter into rows), as Hugging Face does with it installed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rayhf.parallel.buckets import DELTA_CHUNK as CHUNK  # tokens a chunk (priced by the planner)

NORM_EPS = 1e-6  # the L2 norm of q and k: flash-linear-attention's epsilon


def causal_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each channel of ``x [rows, slots, C]`` convolved with its ``weight [C, 1, kernel]`` over
    its row's last ``kernel`` inputs (zeros before the row's start), then SiLU."""
    kernel = weight.shape[-1]
    mixed = F.conv1d(
        x.transpose(1, 2).to(weight.dtype), weight, padding=kernel - 1, groups=x.shape[-1]
    )
    return F.silu(mixed[..., : x.shape[1]]).transpose(1, 2).to(x.dtype)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + NORM_EPS)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked rule over rows: ``q, k [rows, L, heads, dk]`` (as many heads as ``v``),
    ``v [rows, L, heads, dv]``, ``g, beta [rows, L, heads]``; from ``state [rows, heads, dk,
    dv]`` (None: zeros). Returns the outputs ``[rows, L, heads, dv]`` in ``q``'s dtype and the
    final state (fp32)."""
    dtype = q.dtype
    rows, length, heads, dk = k.shape
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # [rows, heads, L, d]
    g, beta = (t.transpose(1, 2).float() for t in (g, beta))  # [rows, heads, L]
    q, k = _unit(q) * dk**-0.5, _unit(k)
    pad = -length % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // CHUNK
    q, k, v = (t.reshape(rows, heads, n, CHUNK, t.shape[-1]) for t in (q, k, v))
    decay = g.reshape(rows, heads, n, CHUNK).cumsum(-1)  # log decay from the chunk's start
    beta = beta.reshape(rows, heads, n, CHUNK, 1)
    # exp(decay_i - decay_j) for j <= i: what is left of token j's write when token i reads
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    fade = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta
    # token i's correction depends on the earlier ones' (a unit lower-triangular system)
    system = (k_beta @ k.transpose(-1, -2)) * fade
    corrections = torch.linalg.solve_triangular(system, v * beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(
        system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True
    )  # how much of the state before the chunk each correction takes back
    within = (q @ k.transpose(-1, -2)) * fade
    q_before = q * decay.exp()[..., None]  # a query reading the state before the chunk
    k_after = k * (decay[..., -1:] - decay).exp()[..., None]  # a write, seen at the chunk's end
    carry = decay[..., -1].exp()[..., None, None]
    s = q.new_zeros(rows, heads, dk, v.shape[-1]) if state is None else state.float()
    outs = []
    for c in range(n):
        fresh = corrections[:, :, c] - reads[:, :, c] @ s
        outs.append(q_before[:, :, c] @ s + within[:, :, c] @ fresh)
        s = s * carry[:, :, c] + k_after[:, :, c].transpose(-1, -2) @ fresh
    if not outs:  # no tokens (a rank's pass beside its ep group's): nothing read or written
        return q.new_zeros(rows, 0, heads, v.shape[-1]).to(dtype), s
    out = torch.stack(outs, dim=2).reshape(rows, heads, n * CHUNK, -1)[:, :, :length]
    return out.transpose(1, 2).to(dtype), s


@functools.cache
def fla_kernel() -> Callable[..., Any] | None:
    """flash-linear-attention's chunked gated delta rule (Triton: GPUs only) where the package
    is installed, else None."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def packed_rule(
    kernel: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule by ``kernel`` (``fla_kernel``'s) over packed sequences of ``lengths`` tokens:
    ``q, k [n, heads, dk]``, ``v [n, heads, dv]``, ``g, beta [n, heads]``, each sequence from
    a zero state. Returns the outputs ``[n, heads, dv]`` in ``q``'s dtype and each sequence's
    final state ``[sequences, heads, dk, dv]`` (fp32)."""
    bounds = F.pad(lengths.cumsum(0), (1, 0))
    out, state = kernel(
        q[None], k[None], v[None], g[None].float(), beta[None].to(q.dtype),
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=bounds,
    )  # fmt: skip
    return out[0].to(q.dtype), state.float()


def split_heads(
    mixed: torch.Tensor, n_keys: int, n_values: int, key_dim: int, value_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Convolved q|k|v ``[..., C]`` as heads ``[..., n_values, dim]``: each key head's q and k
    repeated for the run of value heads it serves."""
    q, k, v = mixed.split([n_keys * key_dim, n_keys * key_dim, n_values * value_dim], dim=-1)
    lead, group = mixed.shape[:-1], n_values // n_keys
    q, k = (t.reshape(*lead, n_keys, key_dim).repeat_interleave(group, -2) for t in (q, k))
    return q, k, v.reshape(*lead, n_values, value_dim)


def history(x: torch.Tensor, lengths: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each row's last ``kernel - 1`` inputs ``[rows, C, kernel - 1]`` (zeros before its
    start), from ``x [rows, slots, C]`` and the rows' ``lengths``: a decode step's convolution
    state after a prefill."""
    padded = F.pad(x, (0, 0, kernel - 1, 0))  # position p at p + kernel - 1
    at = lengths[:, None] + torch.arange(kernel - 1, device=x.device)[None, :]
    return padded.gather(1, at[..., None].expand(-1, -1, x.shape[-1])).transpose(1, 2)


def conv_step(x: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token per row: ``x [n, C]`` convolved with the row's ``past [n, C, kernel - 1]``
    inputs (then SiLU); ``past`` moves on by the token, in place."""
    window = torch.cat([past, x[..., None].to(past.dtype)], dim=-1)
    past.copy_(window[..., 1:])
    # one output per channel: a product and a sum, cheaper than a grouped conv1d's set-up
    mixed = (window.to(weight.dtype) * weight[:, 0]).sum(dim=-1)
    return F.silu(mixed).to(x.dtype)


def rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token per row of the rule (``q, k [n, heads, dk]``, ``v [n, heads, dv]``, ``g,
    beta [n, heads]``) from each row's ``state [n, heads, dk, dv]`` (fp32, moved on in place);
    the outputs ``[n, heads, dv]`` in ``q``'s dtype."""
    dtype = q.dtype
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q, k = _unit(q) * q.shape[-1] ** -0.5, _unit(k)
    s = state * g.exp()[..., None, None]
    error = v - (s * k[..., None]).sum(dim=-2)
    s = s + k[..., None] * (beta[..., None] * error)[..., None, :]
    state.copy_(s)
    return (s * q[..., None]).sum(dim=-2).to(dtype)


def gated_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """RMSNorm of ``x`` over its last dim, times ``weight``, times SiLU of ``gate`` (in fp32),
    in ``x``'s dtype."""
    h = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    return (weight * h.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


def decays(a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """Each token's log decay per value head, ``-exp(A_log) * softplus(a + dt_bias)``, fp32."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias)
