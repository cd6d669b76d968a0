"""Context parallelism: each sequence of a batch split over ``cp`` ranks (DeepSpeed-Ulysses).

The ``cp`` ranks of a group hold the same rows, packed (``[n, ...]``), and each keeps one
contiguous ``1/cp`` slice of the tokens (the stream padded to a multiple of ``cp`` with a row of
its own). Every layer but attention works token by token, so it runs on the slice as it is. An
attention layer exchanges its queries, keys and values by one all-to-all each (``to_heads``):
afterwards each rank holds every token of ``1/cp`` of this rank's heads, attends over whole rows
exactly as without cp, and a second all-to-all (``to_tokens``) gives each rank its tokens back
with all the heads. The work of a causal mask is therefore the same on every rank (heads split,
not positions), with no reordering of the tokens.

The last stage gathers its slice's outputs over the group (``gather_tokens``), so every rank of
the group sees the whole batch's log-probs or values and runs the same loss; a rank's backward
then carries the gradient of its own tokens only, and the sum over the group's ranks is the
whole batch's gradient (``rayhf.engines.torch_trainer.global_scales`` scales for it). Each
exchange is an autograd function whose backward is the opposite exchange.

With tensor parallelism, ``cp`` splits each tp rank's heads again: the query heads of a tp rank
must be a multiple of ``cp``; where its key/value heads are not, they are repeated to one per
query head before the exchange (grouped-query attention then costs the bytes of full attention
in the exchange, not in the weights). Why Ulysses and not ring attention, and why cp is carved
out of dp: ``docs/decisions/0099-context-parallelism-is-ulysses-carved-out-of-dp.md``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def padding(n_tokens: int, cp: int) -> int:
    """Tokens to add so that ``n_tokens`` splits into ``cp`` equal slices."""
    return -n_tokens % cp


def local_slice(n_tokens: int, cp: int, cp_rank: int) -> slice:
    """The tokens rank ``cp_rank`` holds of a stream of ``n_tokens`` (a multiple of ``cp``)."""
    size = n_tokens // cp
    return slice(cp_rank * size, (cp_rank + 1) * size)


def _exchange(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``x [cp, ...]``: part ``j`` to rank ``j``; the result's part ``j`` came from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _heads(x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[n/cp, h, d]`` (this rank's tokens, every head) -> ``[n, h/cp, d]``."""
    local, h, d = x.shape
    parts = x.reshape(local, cp, h // cp, d).transpose(0, 1)  # [cp, n/cp, h/cp, d]
    return _exchange(parts, group).reshape(cp * local, h // cp, d)


def _tokens(x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``[n, h/cp, d]`` (every token, this rank's heads) -> ``[n/cp, h, d]``."""
    n, h, d = x.shape
    got = _exchange(x.reshape(cp, n // cp, h, d), group)  # [cp (their heads), n/cp, h/cp, d]
    return got.transpose(0, 1).reshape(n // cp, cp * h, d)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.cp, ctx.group = cp, group
        return _heads(x, cp, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _tokens(grad, ctx.cp, ctx.group), None, None


class _ToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.cp, ctx.group = cp, group
        return _tokens(x, cp, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _heads(grad, ctx.cp, ctx.group), None, None


def to_heads(x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's tokens with all its heads ``[n/cp, h, d]`` -> every token of the group with
    the rank's ``1/cp`` of the heads ``[n, h/cp, d]`` (``h`` a multiple of ``cp``)."""
    return _ToHeads.apply(x, cp, group)


def to_tokens(x: torch.Tensor, cp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The inverse of ``to_heads``."""
    return _ToTokens.apply(x, cp, group)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cp: int, rank: int, group: dist.ProcessGroup):
        ctx.rank, ctx.size = rank, len(x)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # every rank of the group computes the same loss from the same gathered tensor: the
        # gradient of its own slice is its slice of that loss's gradient
        lo = ctx.rank * ctx.size
        return grad[lo : lo + ctx.size], None, None, None


def gather_tokens(x: torch.Tensor, cp: int, rank: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Each rank's slice ``[n/cp, ...]`` -> the group's whole stream ``[n, ...]``, in order."""
    return _Gather.apply(x, cp, rank, group)


def attention_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, group: dist.ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``to_heads`` of a layer's queries, keys and values; key/value heads that ``cp`` does
    not divide are first repeated to one per query head."""
    if k.shape[1] % cp:
        group_size = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group_size, dim=1) for t in (k, v))
    return to_heads(q, cp, group), to_heads(k, cp, group), to_heads(v, cp, group)
