"""A role group: the Ray actors that hold one role in one layout, one per device of its mesh.

Actors are named ``{role}.{layout}[{rank}]`` so the dashboard shows roles; rank order is
``(dp_rank * pp + pp_rank) * tp + tp_rank`` over the layout's mesh. A replica's head rank (tp 0,
stage 0) is the one whose call outputs flow on to other calls (``rayhf.runtime.driver``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayhf.parallel.layout import Layout
from rayhf.runtime.cluster import DEVICE_RESOURCE, DeviceCluster
from rayhf.runtime.messages import WorkerSpec
from rayhf.runtime.waits import Pending, gather, pending
from rayhf.runtime.worker import RoleWorker

RemoteWorker = ray.remote(RoleWorker)


class RoleGroup:
    def __init__(
        self,
        role: str,
        layout: Layout,
        spec_for_rank: Callable[[int], WorkerSpec],
        devices: DeviceCluster,
        share: float,
        namespace: str,
        flat: bool = False,
        dtype: str = "fp32",
        timeout_s: float = 3600,
    ) -> None:
        """Start one actor per mesh device; ``share`` is the fraction of a device each takes.
        ``flat``: the ranks will hold flat slices of the weights (DeepSpeed ZeRO-3); ``dtype``:
        what they keep the weights in (fp32, bf16, fp16); ``timeout_s``: the longest a call on
        every actor (``call_all``) may take."""
        self.role, self.layout, self.flat, self.dtype = role, layout, flat, dtype
        self.timeout_s = timeout_s
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

    def replica(self, dp_rank: int) -> list[Any]:
        n = self.ranks_per_replica
        return self.actors[dp_rank * n : (dp_rank + 1) * n]

    def pending(self, rank: int, ref: Any, doing: str) -> Pending:
        return pending(ref, self.actors[rank], self.role, self.actor_name(rank), doing)

    def call_all(self, doing: str, method: str, *args: Any) -> list[Any]:
        """``method(*args)`` on every actor, waited for through the one failure path."""
        refs = [getattr(a, method).remote(*args) for a in self.actors]
        return gather([self.pending(r, ref, doing) for r, ref in enumerate(refs)], self.timeout_s)

    def setup(self) -> None:
        """Wait for the actors, join their process groups, shard the model."""
        address = ""  # a lone actor joins no group
        if len(self.actors) > 1:
            ref = self.actors[0].rendezvous_address.remote()
            (address,) = gather([self.pending(0, ref, "start-up")], self.timeout_s)
        self.call_all("start-up", "setup", address)

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
