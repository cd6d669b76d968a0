"""Reductions over a role group's data-parallel replicas, as algorithms use them (statistics,
advantage normalisation, gathering per-replica objects). Identity with one replica."""

from __future__ import annotations

import torch
import torch.distributed as dist


class DataParallel:
    """The dp group of one rank (None: a single replica)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    @property
    def size(self) -> int:
        """The replicas."""
        return 1 if self.group is None else dist.get_world_size(self.group)

    def _device(self) -> torch.device:
        """Where the group reduces: NCCL only takes tensors on this process's GPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        """Mean of each value over the dp ranks."""
        if self.group is None or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        t /= dist.get_world_size(self.group)
        return dict(zip(keys, t.tolist(), strict=True))

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over the dp ranks, on ``t``'s device."""
        if self.group is None:
            return t
        out = t.to(self._device(), copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(t.device)

    def all_gather_object(self, obj: object) -> list[object]:
        """``obj`` from every dp rank, in rank order."""
        if self.group is None:
            return [obj]
        out: list[object] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out
