"""A role group: the Ray actors that hold one role in one layout, one per device of its mesh.

Actors are named ``{role}.{layout}[{rank}]`` so the dashboard shows roles; rank order is
``(dp_rank * pp + pp_rank) * tp + tp_rank`` over the layout's mesh. The group spreads a call's
batch over its data-parallel replicas (balanced by tokens; every tp/pp rank of a replica gets the
replica's share), and joins the replicas' results, read from each replica's head rank, in the
original sample order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhf.data.batch import PackedBatch
from rayhf.errors import RunFailed
from rayhf.planner import Layout
from rayhf.runtime.cluster import DEVICE_RESOURCE, DeviceCluster
from rayhf.runtime.messages import CallRequest, CallResult, WorkerSpec
from rayhf.runtime.worker import DISPATCH, RoleWorker

RemoteWorker = ray.remote(RoleWorker)


@dataclass
class CallOutcome:
    """The joined result of one call over the group's ranks."""

    batch: PackedBatch | None
    stats: dict[str, float]
    compute_seconds: float  # the slowest rank's compute time


class RoleGroup:
    def __init__(
        self,
        role: str,
        layout: Layout,
        spec_for_rank: Callable[[int], WorkerSpec],
        devices: DeviceCluster,
        share: float,
        namespace: str,
    ) -> None:
        """Start one actor per mesh device; ``share`` is the fraction of a device each takes."""
        self.role, self.layout = role, layout
        self.key = f"{role}.{layout.name}"  # unique per run: names its actors and transfer groups
        self.actors: list[Any] = []  # ActorHandle[RoleWorker]
        for rank, device in enumerate(layout.mesh):
            strategy = PlacementGroupSchedulingStrategy(devices.pg, device)
            resources = {} if devices.gpu else {DEVICE_RESOURCE: share}
            actor = RemoteWorker.options(
                name=self.actor_name(rank),
                namespace=namespace,
                num_cpus=devices.cpus_per_device * share,
                num_gpus=share if devices.gpu else 0,
                resources=resources,
                scheduling_strategy=strategy,
                max_concurrency=1,
            ).remote(spec_for_rank(rank))
            self.actors.append(actor)

    def actor_name(self, rank: int) -> str:
        return f"{self.role}.{self.layout.name}[{rank}]"

    @property
    def ranks_per_replica(self) -> int:
        return self.layout.tp * self.layout.pp

    @property
    def heads(self) -> list[Any]:
        """One actor per data-parallel replica: the one whose results the driver reads."""
        return self.actors[:: self.ranks_per_replica]

    def replica(self, dp_rank: int) -> list[Any]:
        n = self.ranks_per_replica
        return self.actors[dp_rank * n : (dp_rank + 1) * n]

    def setup(self) -> None:
        """Wait for the actors, join their process groups, shard the model."""
        address = ray.get(self.actors[0].rendezvous_address.remote())
        ray.get([a.setup.remote(address) for a in self.actors])

    def submit(
        self, call: str, kind: str, step: int, batch: PackedBatch, evaluate: bool = False
    ) -> list[ray.ObjectRef]:
        split, _ = DISPATCH[kind]
        assert split == "split"
        parts = batch.split(self.layout.dp, by_key=_balance_key(batch))
        return [
            a.run.remote(CallRequest(call, step, parts[i // self.ranks_per_replica], evaluate))
            for i, a in enumerate(self.actors)
        ]

    def join(self, kind: str, results: list[CallResult], order: list[int]) -> CallOutcome:
        _, how = DISPATCH[kind]
        seconds = max(r.seconds for r in results)
        results = results[:: self.ranks_per_replica]  # the replicas' head ranks
        if how == "first":
            return CallOutcome(None, results[0].stats, seconds)
        batches = [r.batch for r in results if r.batch is not None and r.batch.n_samples]
        joined = PackedBatch.concat(batches)
        if sorted(joined.sample_ids) == sorted(order):
            joined = joined.reorder(order)  # else new samples (several per input): rank order
        return CallOutcome(joined, {}, seconds)

    def run(
        self, call: str, kind: str, step: int, batch: PackedBatch, evaluate: bool = False
    ) -> CallOutcome:
        results = self.wait(self.submit(call, kind, step, batch, evaluate), f"call '{call}'")
        return self.join(kind, results, batch.sample_ids)

    def wait(self, refs: list[ray.ObjectRef], what: str) -> list[Any]:
        """The results of one task per actor (rank order). The first actor found dead stops the
        wait at once: its peers may be blocked in a collective with it and never return."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise RunFailed(
                    f"role '{self.role}': actor {self.actor_name(rank)} died during {what} "
                    f"({cause})"
                ) from e
        return [results[rank] for rank in range(len(refs))]

    def release(self) -> None:
        """Drop a copy's weights after its call (reallocation refills them)."""
        self.wait([a.release_weights.remote() for a in self.actors], "release of a copy")

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


def _balance_key(batch: PackedBatch) -> str:
    for key in ("seq", "prompts"):
        if key in batch.tensors:
            return key
    return batch.keys()[0]
