"""The driver side of reallocation: plan once per layout pair, then have the role groups'
actors exchange their slices over a transfer group made lazily per pair of role groups.

    move(src group, dst group)
      -> plan_realloc(spec, src.layout, dst.layout)         (cached per layout pair)
      -> transfer group over src actors + dst actors          (created once, cached)
      -> every source actor: realloc_send(its slices, by peer)                   } concurrently
         every destination actor: realloc_recv(its slices, by peer,             }
                                               what it relays, by peer)         }
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray

from rayhf.models.precision import DTYPES
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.realloc.plan import ReallocPlan, Transfer, plan_realloc


@dataclass(frozen=True)
class ReallocStats:
    seconds: float
    bytes: int  # bytes that arrived, summed over destination ranks


@dataclass(frozen=True)
class Routes:
    """A move between two role groups: the transfer group, and by rank what each side moves."""

    group: str
    sends: dict[int, dict[int, list[Transfer]]]  # source rank -> transfer-group peer -> slices
    recvs: dict[int, dict[int, list[Transfer]]]  # destination rank -> peer -> slices
    dtype: str  # what the slices travel in: the destination's weight dtype
    forwards: dict[int, dict[int, list[Transfer]]] = field(default_factory=dict)  # relays


class GroupRef(Protocol):
    """What reallocation needs of a role group (``rayhf.runtime.role_group.RoleGroup`` is one)."""

    key: str  # unique and stable, e.g. "actor.d0-1.dp1tp2pp1"
    layout: Layout
    actors: list[Any]
    flat: bool  # its dp ranks hold flat slices of every parameter (DeepSpeed ZeRO-3)
    dtype: str  # what its ranks keep the weights in: fp32, bf16, fp16


# How the mover waits for its actor calls: (group, rank, object ref) each, and what they do;
# returns their results in order. The runtime passes its one failure path (``runtime.waits``).
Wait = Callable[[Sequence[tuple[GroupRef, int, Any]], str], list[Any]]


def ray_get_all(calls: Sequence[tuple[GroupRef, int, Any]], doing: str) -> list[Any]:
    """The plain wait: ``ray.get`` of every ref (benchmarks and tests)."""
    return ray.get([ref for _, _, ref in calls])


class TransferGroupMover:
    """Slices move directly between the actors that hold and need them, relayed from replica to
    replica (``relay=False``: every replica gets its slices from a source rank), through shared
    memory between processes of one host (``shm=False``: over the transfer group's sockets),
    and with ``ipc`` between processes on one GPU through its memory."""

    def __init__(
        self, relay: bool = True, wait: Wait = ray_get_all, shm: bool = True, ipc: bool = False
    ) -> None:
        self.relay, self.wait, self.shm, self.ipc = relay, wait, shm, ipc
        self._plans: dict[tuple[ModelSpec, Layout, Layout, bool, int, bool], ReallocPlan] = {}
        self._groups: dict[tuple[str, ...], dict[str, int]] = {}  # members -> rank offset per group

    def plan(
        self,
        spec: ModelSpec,
        src: Layout,
        dst: Layout,
        flat: bool = False,
        itemsize: int = 4,
        skip_frozen: bool = False,
    ) -> ReallocPlan:
        key = (spec, src, dst, flat, itemsize, skip_frozen)
        if key not in self._plans:
            self._plans[key] = plan_realloc(spec, src, dst, itemsize, flat, self.relay, skip_frozen)
        return self._plans[key]

    def _group(self, a: GroupRef, b: GroupRef) -> tuple[str, dict[str, int]]:
        """The transfer group over both role groups' actors (one per pair, either direction)."""
        members = tuple(sorted((a.key, b.key)))
        name = "+".join(members)
        if members not in self._groups:
            ordered = sorted((a, b), key=lambda g: g.key)
            offsets: dict[str, int] = {}
            ranks: list[tuple[GroupRef, int]] = []  # transfer-group rank -> (group, its rank)
            for g in ordered:
                offsets[g.key] = len(ranks)
                ranks.extend((g, r) for r in range(len(g.actors)))
            doing = f"joining transfer group {name}"
            head = ordered[0]
            (address,) = self.wait([(head, 0, head.actors[0].rendezvous_address.remote())], doing)
            shared = bool(set(a.layout.mesh) & set(b.layout.mesh))
            joins = [
                (
                    g,
                    r,
                    g.actors[r].join_transfer_group.remote(
                        name, address, i, len(ranks), shared, self.shm, self.ipc
                    ),
                )
                for i, (g, r) in enumerate(ranks)
            ]
            self.wait(joins, doing)
            self._groups[members] = offsets
        return name, self._groups[members]

    def routes(
        self, src: GroupRef, dst: GroupRef, spec: ModelSpec, skip_frozen: bool = False
    ) -> Routes:
        """Who sends and receives what to move ``spec``'s weights ``src`` -> ``dst`` (joins the
        transfer group the first time the pair meets). The slices travel in the destination's
        dtype (a bf16 copy of fp32 master weights receives half the bytes). ``skip_frozen``: a
        LoRA role's base weights stay out (``dst`` holds them: only the adapters move)."""
        assert not dst.flat, "a ZeRO-3 role group sends weights, it does not receive them"
        itemsize = DTYPES[dst.dtype].itemsize
        plan = self.plan(spec, src.layout, dst.layout, src.flat, itemsize, skip_frozen)
        name, offset = self._group(src, dst)
        s0, d0 = offset[src.key], offset[dst.key]
        sends = {r: plan.sent_by(r, d0) for r in range(len(src.actors)) if plan.for_src(r)}
        recvs = {r: plan.received_by(r, s0, d0) for r in range(len(dst.actors))}
        forwards = {
            r: plan.forwarded_by(r, d0) for r in range(len(dst.actors)) if plan.relays_from(r)
        }
        return Routes(name, sends, recvs, dst.dtype, forwards)

    def move(
        self,
        src: GroupRef,
        dst: GroupRef,
        spec: ModelSpec,
        eta: float | None = None,
        skip_frozen: bool = False,
    ) -> ReallocStats:
        """Make ``dst`` hold ``spec``'s weights as ``src`` holds them (``eta``: blend
        ``dst = eta * src + (1 - eta) * dst`` instead of copying; ``skip_frozen``: all but a
        LoRA role's base weights, which ``dst`` holds already)."""
        start = time.perf_counter()
        routes = self.routes(src, dst, spec, skip_frozen)
        recvs = [
            (dst, r, dst.actors[r].realloc_recv.remote(
                routes.group, by_peer, eta, routes.forwards.get(r, {})
            ))
            for r, by_peer in routes.recvs.items()
        ]  # fmt: skip
        sends = [
            (src, r, src.actors[r].realloc_send.remote(routes.group, by_peer, routes.dtype))
            for r, by_peer in routes.sends.items()
        ]
        results = self.wait([*recvs, *sends], f"weight move {src.key} -> {dst.key}")
        return ReallocStats(time.perf_counter() - start, sum(results[: len(recvs)]))


class ObjectStoreCopy:
    """The naive path, kept as the baseline: the source's first replica gathers the whole state
    dict into its head actor, which puts it in the object store once; every destination rank
    fetches all of it and keeps its own shards."""

    def move(
        self, src: GroupRef, dst: GroupRef, spec: ModelSpec, eta: float | None = None
    ) -> ReallocStats:
        assert eta is None, "the object-store path only copies"
        assert not src.flat, "the object-store path gathers one replica, which ZeRO-3 lacks"
        start = time.perf_counter()
        # a collective over the first replica (and those holding the rest of its experts)
        replica = src.actors[: src.layout.tp * src.layout.pp * src.layout.ep]
        refs = [a.get_weights.remote() for a in replica]
        received = ray.get([a.set_weights.remote(refs[0]) for a in dst.actors])
        ray.get(refs[1:])
        return ReallocStats(time.perf_counter() - start, sum(received))
