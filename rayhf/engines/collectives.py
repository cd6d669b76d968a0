"""Reductions over a role group's data-parallel replicas, as algorithms use them (statistics,
advantage normalisation, gathering per-replica objects). Identity with one replica."""

from __future__ import annotations

import torch
import torch.distributed as dist


class DataParallel:
    """The dp group of one rank (None: a single replica)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        """Mean of each value over the dp ranks."""
        if self.group is None or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        t /= dist.get_world_size(self.group)
        return dict(zip(keys, t.tolist(), strict=True))

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather_object(self, obj: object) -> list[object]:
        """``obj`` from every dp rank, in rank order."""
        if self.group is None:
            return [obj]
        out: list[object] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out
