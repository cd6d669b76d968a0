"""Tensor-parallel collectives with the autograd rules of Megatron-style layers.

- ``copy_to_tp``: before a column-parallel layer. Forward: identity (every rank has the full
  input). Backward: all-reduce, since each rank's gradient covers only its output columns.
- ``reduce_from_tp``: after a row-parallel layer (and the vocab-parallel embedding). Forward:
  all-reduce the partial sums. Backward: identity.
- ``gather_from_tp``: after the vocab-parallel LM head. Forward: all-gather along the last dim
  (chunks may differ by one). Backward: keep this rank's chunk; the loss after it is computed
  identically on every tp rank, so no reduction is needed.

With ``group=None`` (tp = 1) all three are the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rayhf.models.sharding import chunk_bounds


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup, full: int) -> torch.Tensor:
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        sizes = [chunk_bounds(full, tp, r) for r in range(tp)]
        width = max(hi - lo for lo, hi in sizes)
        padded = torch.nn.functional.pad(x, (0, width - x.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(tp)]
        dist.all_gather(parts, padded, group=group)
        ctx.bounds = sizes[rank]
        return torch.cat([p[..., : hi - lo] for p, (lo, hi) in zip(parts, sizes, strict=True)], -1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        lo, hi = ctx.bounds
        return grad[..., lo:hi].contiguous(), None, None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None, full: int) -> torch.Tensor:
    """Concatenate every tp rank's last-dim chunk into the ``full``-wide tensor."""
    return x if group is None else _GatherFromTP.apply(x, group, full)
