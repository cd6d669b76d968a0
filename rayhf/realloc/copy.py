"""Full-weight copy between role groups through the Ray object store."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import ray


@dataclass(frozen=True)
class ReallocStats:
    seconds: float
    bytes: int  # bytes kept (the destination shards), summed over destination ranks


class WeightCopy(Protocol):
    def copy(self, src_actors: list[Any], dst_actors: list[Any]) -> ReallocStats: ...


class ObjectStoreCopy:
    """The source's first replica gathers its shards into one state dict, which goes into the
    object store once; every destination rank keeps its own shards of it.

    Data-parallel replicas hold identical weights, so one source replica suffices.
    ``src_replica`` is that replica's actors in rank order (its head, rank 0, first).
    """

    def copy(self, src_replica: list[Any], dst_actors: list[Any]) -> ReallocStats:
        start = time.perf_counter()
        refs = [a.get_weights.remote() for a in src_replica]  # a collective over the replica
        weights_ref = refs[0]
        received = ray.get([a.set_weights.remote(weights_ref) for a in dst_actors])
        ray.get(refs[1:])
        return ReallocStats(time.perf_counter() - start, sum(received))
