"""Reallocation planning: which slices of which parameters move from which rank to which when a
role's weights go from layout A to layout B, and down which path. Pure: no Ray, no processes.

    what each destination rank needs, and who holds it       (rayhf.realloc.needs: contents)
      -> a needer on a device that holds it: a local copy    (no bytes cross devices)
      -> the other needers of the same slices: one stream per holder, each carrying a share
         of the slices (every source replica sends), down a chain of the needers:
             holder -> needer 1 -> needer 2 -> ... -> needer k
         each needer forwards what it received to the next (``relay``), message by message
         (``CHUNK_BYTES``), so the holder sends every byte once however many replicas need it

A move lasts at least as long as the busiest device takes to receive what it lacks; with relays
no device sends more than that either, except where a source alone holds slices that more
devices need than it has bytes for (a tp=4 source to a tp=8 destination on other devices:
each source byte goes to one destination, so each source sends twice what a destination gets).
``ReallocPlan`` reports both per device (bytes that cross devices); tests/unit/realloc holds the
property over every layout pair. Chains are ordered so the device that already sends the most
comes last (it forwards nothing); ``relay=False`` sends every needer its slices straight from a
holder (the point-to-point plan, kept to measure against).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from rayhf.errors import RayhfError
from rayhf.models.sharding import param_shards
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.realloc.balance import balanced_routes
from rayhf.realloc.needs import Content, Experts, View, contents
from rayhf.realloc.route import (
    SENDER,
    Hops,
    Route,
    greedy_routes,
    send_floor,
    split_local,
)

CHUNK_BYTES = 4 * 2**20  # a message: what a relay forwards as soon as it has arrived
# a bucket this large goes through shared memory between processes of one host (smaller ones
# over the transfer group: their header would cost what they cost); ``rayhf.realloc.shm``
SHM_MIN_BYTES = 2**20


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, stop)`` along ``dim`` of parameter ``name`` from ``src`` to ``dst``;
    ``src_offset``/``dst_offset`` locate the rows inside each side's local shard. ``src`` is a
    source layout rank, or with ``relay`` a destination rank forwarding what it received."""

    name: str
    dim: int
    start: int
    stop: int
    src: int
    dst: int
    src_offset: int
    dst_offset: int
    nbytes: int
    cross: tuple[int, int] | None = None  # 2-D: the range along the other dim (None: all)
    src_view: View | None = None  # flat source: size, stride
    stream: int = 0  # every hop of a stream carries the same slices in the same order
    relay: bool = False
    experts: Experts | None = None  # split experts: see ``Content.experts``


@dataclass(frozen=True)
class Stream:
    """Slices that ``sender`` (a source rank) sends down a tree of destination ranks: each hop
    ``(a, b)`` goes from ``a`` (``SENDER``: the sender; else a destination rank forwarding what
    it received on an earlier hop) to destination rank ``b``."""

    index: int
    sender: int
    hops: Hops
    contents: tuple[Content, ...]
    nbytes: int = field(init=False, compare=False)  # of every slice, once

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", sum(c.total_bytes for c in self.contents))

    @property
    def receivers(self) -> tuple[int, ...]:
        return tuple(b for _, b in self.hops)

    @property
    def depth(self) -> int:
        """The most hops between the sender and a receiver."""
        return _depth(self.hops)


@dataclass
class ReallocPlan:
    """The streams of one A -> B reallocation, and what each device sends and receives to and
    from other devices (``local``: what it copies between the processes it hosts)."""

    src: Layout
    dst: Layout
    routes: list[Route] = field(default_factory=list)  # (sender, hops, slices) per stream
    sent: dict[int, int] = field(default_factory=dict)  # device -> bytes to other devices
    received: dict[int, int] = field(default_factory=dict)  # device -> bytes from other devices
    local: dict[int, int] = field(default_factory=dict)  # device -> bytes between its processes
    # the least the busiest device must send: what only some devices hold, shared among them
    # (where the greedy routing misses that, the least any routing through the devices that
    # hold or need each slice achieves: rayhf.realloc.balance)
    send_floor: int = 0
    depth: int = 0  # the most hops between devices any slice takes (0: none crosses devices)
    # the relay pipeline's fill: the most bytes a stream's last receiver waits for before its
    # stream flows, the first message (up to CHUNK_BYTES) once per hop before the last
    fill: int = 0

    @functools.cached_property
    def streams(self) -> list[Stream]:
        return [Stream(i, h, hops, tuple(cs)) for i, (h, hops, cs) in enumerate(self.routes)]

    @property
    def total_bytes(self) -> int:
        """What the destination ranks receive, summed (local copies included)."""
        return sum(s.nbytes * len(s.hops) for s in self.streams)

    @property
    def max_sent(self) -> int:
        return max(self.sent.values(), default=0)

    @property
    def max_received(self) -> int:
        return max(self.received.values(), default=0)

    @property
    def bound(self) -> int:
        """The fewest bytes the busiest device must send or receive: a move's lower bound."""
        return max(self.max_received, self.send_floor)

    @functools.cached_property
    def transfers(self) -> list[Transfer]:
        """Every hop of every stream, one transfer per parameter slice, stream by stream."""
        out = []
        for s in self.streams:
            for a, b in s.hops:
                out += [_transfer(s, c, name, a, b) for c in s.contents for name in c.names]
        return out

    @functools.cached_property
    def _index(self) -> dict[tuple[str, int], list[Transfer]]:
        out: dict[tuple[str, int], list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            out["relay" if t.relay else "src", t.src].append(t)
            out["dst", t.dst].append(t)
        return out

    def for_src(self, rank: int) -> list[Transfer]:
        """What source rank ``rank`` sends."""
        return self._index.get(("src", rank), [])

    def for_dst(self, rank: int) -> list[Transfer]:
        """What destination rank ``rank`` receives (from source ranks and relays)."""
        return self._index.get(("dst", rank), [])

    def relays_from(self, rank: int) -> list[Transfer]:
        """What destination rank ``rank`` forwards to the next ranks of its chains."""
        return self._index.get(("relay", rank), [])

    # the same, by peer: in a transfer group whose source ranks start at s0, destination at d0
    def sent_by(self, rank: int, d0: int) -> dict[int, list[Transfer]]:
        return _by_peer(self.for_src(rank), lambda t: d0 + t.dst)

    def received_by(self, rank: int, s0: int, d0: int) -> dict[int, list[Transfer]]:
        return _by_peer(self.for_dst(rank), lambda t: (d0 if t.relay else s0) + t.src)

    def forwarded_by(self, rank: int, d0: int) -> dict[int, list[Transfer]]:
        return _by_peer(self.relays_from(rank), lambda t: d0 + t.dst)


def _by_peer(
    transfers: list[Transfer], peer_of: Callable[[Transfer], int]
) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[peer_of(t)].append(t)
    return dict(out)


def _transfer(s: Stream, c: Content, name: str, a: int, b: int) -> Transfer:
    """Hop ``(a, b)`` of ``s`` for ``name``'s slice of ``c``: from the sender's shard, or from
    what the forwarding rank received (laid out as in its own shard)."""
    if a == SENDER:
        return Transfer(
            name, c.dim, c.start, c.stop, s.sender, b, c.src_offset, c.dst_offset, c.nbytes,
            c.cross, c.src_view, s.index, experts=c.experts,
        )  # fmt: skip
    # a relay's shard is a destination's: the slice sits where the next rank keeps it too
    relayed = None if c.experts is None else (c.experts[1], c.experts[1], c.experts[2])
    return Transfer(
        name, c.dim, c.start, c.stop, a, b, c.dst_offset, c.dst_offset, c.nbytes, c.cross,
        None, s.index, relay=True, experts=relayed,
    )  # fmt: skip


def check_compatible(src: ModelSpec, dst: ModelSpec, what: str) -> None:
    """Refuse a reallocation between models whose parameters differ (names or shapes)."""
    a = {p.name: p.shape for p in param_shards(src)}
    b = {p.name: p.shape for p in param_shards(dst)}
    for name in sorted(a.keys() | b.keys()):
        if a.get(name) != b.get(name):
            raise RayhfError(
                f"{what}: the models differ at parameter {name} "
                f"(source {a.get(name, 'missing')}, destination {b.get(name, 'missing')}); "
                f"reallocation needs the same architecture and shapes"
            )


def plan_realloc(
    spec: ModelSpec,
    src: Layout,
    dst: Layout,
    itemsize: int = 4,
    src_flat: bool = False,
    relay: bool = True,
    skip_frozen: bool = False,
) -> ReallocPlan:
    """The streams that turn ``spec``'s weights in layout ``src`` into layout ``dst``
    (``src_flat``: the source's dp ranks hold flat slices, ZeRO-3; ``relay``: needers forward
    to each other, else every needer gets its slices from a holder; ``skip_frozen``: only what
    changes in a run, a LoRA role's base weights left where the destination holds them)."""
    needed = contents(spec, src, dst, itemsize, src_flat, skip_frozen)
    copies, groups = split_local(needed, src, dst)
    floor = send_floor(groups, src)
    plan = _plan(src, dst, copies + greedy_routes(groups, src, dst, relay), floor)
    if relay and groups and plan.max_sent > plan.bound:  # the greedy routing missed it
        routes, least = balanced_routes(groups, src, dst)
        floor = max(floor, math.ceil(least))
        exact = _plan(src, dst, copies + routes, floor)
        plan.send_floor = floor
        if exact.max_sent < plan.max_sent:
            return exact
    return plan


@dataclass(frozen=True)
class MoveLoad:
    """What prices a move: the bytes the busiest device moves (what it sends or receives across
    devices, whichever is more, plus what it copies between its own processes), the most hops a
    slice takes (a relay pipeline's depth) and the pipeline's fill: the most bytes a stream's
    last hop waits for, its first message (up to ``CHUNK_BYTES``) once per hop before it."""

    busiest: int
    depth: int
    fill: int


def move_load(
    spec: ModelSpec,
    src: Layout,
    dst: Layout,
    itemsize: int = 4,
    src_flat: bool = False,
    skip_frozen: bool = False,
) -> MoveLoad:
    """``plan_realloc``'s load, cached on the pair's shape: renumbering the devices in order
    changes no routing decision (they compare devices only for equality and order)."""
    order = {d: i for i, d in enumerate(sorted(set(src.mesh) | set(dst.mesh)))}
    a = replace(src, mesh=tuple(order[d] for d in src.mesh))
    b = replace(dst, mesh=tuple(order[d] for d in dst.mesh))
    return _load(spec, a, b, itemsize, src_flat, skip_frozen)


@functools.lru_cache(maxsize=65536)
def _load(
    spec: ModelSpec, src: Layout, dst: Layout, itemsize: int, src_flat: bool, skip_frozen: bool
) -> MoveLoad:
    plan = plan_realloc(spec, src, dst, itemsize, src_flat, skip_frozen=skip_frozen)
    devices = set(plan.sent) | set(plan.received) | set(plan.local)
    busiest = max(
        (max(plan.sent.get(d, 0), plan.received.get(d, 0)) + plan.local.get(d, 0) for d in devices),
        default=0,
    )
    return MoveLoad(busiest, plan.depth, plan.fill)


def _plan(src: Layout, dst: Layout, routes: list[Route], floor: int) -> ReallocPlan:
    """The plan of ``routes``, with what each device sends and receives."""
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    local: dict[int, int] = defaultdict(int)
    depth = fill = 0
    for sender, hops, cs in routes:
        nbytes = sum(c.total_bytes for c in cs)
        crossed = False
        for a, b in hops:
            here, there = src.mesh[sender] if a == SENDER else dst.mesh[a], dst.mesh[b]
            if here == there:
                local[here] += nbytes
            else:
                sent[here] += nbytes
                received[there] += nbytes
                crossed = True
        if crossed:
            hops_deep = _depth(hops)
            depth = max(depth, hops_deep)
            fill = max(fill, (hops_deep - 1) * min(CHUNK_BYTES, nbytes))
    return ReallocPlan(
        src, dst, routes, dict(sent), dict(received), dict(local), floor, depth, fill
    )


def _depth(hops: Hops) -> int:
    level = {SENDER: 0}
    for a, b in hops:
        level[b] = level[a] + 1
    return max(level.values())
