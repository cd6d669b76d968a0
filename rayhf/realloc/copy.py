"""Full-weight copy between role groups through the Ray object store."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import ray


@dataclass(frozen=True)
class ReallocStats:
    seconds: float
    bytes: int  # bytes received, summed over destination ranks


class WeightCopy(Protocol):
    def copy(self, src_actors: list[Any], dst_actors: list[Any]) -> ReallocStats: ...


class ObjectStoreCopy:
    """Source rank 0 puts its state dict in the object store once; every destination loads it.

    Data-parallel replicas hold identical weights, so one source suffices.
    """

    def copy(self, src_actors: list[Any], dst_actors: list[Any]) -> ReallocStats:
        start = time.perf_counter()
        weights_ref = src_actors[0].get_weights.remote()
        received = ray.get([a.set_weights.remote(weights_ref) for a in dst_actors])
        return ReallocStats(time.perf_counter() - start, sum(received))
