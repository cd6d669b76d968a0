"""Moving planned slices between processes: point-to-point over a process group of the actors
involved, bucketed, inside each actor. No Ray here; the driver side is ``mover.py``.

A ``TransferGroup`` is an independent torch process group (gloo for CPU tensors, NCCL for GPU
tensors) over one set of actors, made from its own TCP store, so an actor can belong to its role
group's dp/tp/pp world and to any number of transfer groups at once. NCCL refuses a communicator
with two ranks on one GPU ("Duplicate GPU detected"), which is what role groups colocated on the
same GPUs are: their groups run gloo, each GPU slice staged through host memory. (Ray's
``ray.util.collective`` gloo groups reuse the process's default torch world, which our actors
already own for their layout; see docs/decisions/.) Between members on one host, a gloo
group's large messages go through shared memory instead of its sockets (``shm.py``), and with
``ipc`` between members on one GPU through its memory (``cuda_ipc.py``).

Both sides of a hop walk the same transfers of a stream in the same order, so they cut the same
buckets (at most ``bucket_bytes``) and the same messages (at most ``CHUNK_BYTES`` of a bucket);
every hop of a stream carries the same slices, so a rank that relays forwards each message it
received, unchanged, to the stream's next ranks as soon as it has arrived (a pipeline).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rayhf.parallel.groups import STORE_TIMEOUT
from rayhf.realloc import cuda_ipc, shm
from rayhf.realloc.plan import CHUNK_BYTES, SHM_MIN_BYTES, Transfer


class ShardSource(Protocol):
    """What a sending rank offers a move (``rayhf.engines.RankModel``, a ZeRO-3 rank's slices)."""

    def source_shards(self) -> dict[str, torch.Tensor]:
        """This rank's local piece of every parameter, by Hugging Face name."""
        ...


class ShardSink(Protocol):
    """What a receiving rank offers a move (``rayhf.engines.RankModel``)."""

    def receive_buffers(self) -> dict[str, torch.Tensor]:
        """This rank's local piece of every parameter, with storage, for the move to fill."""
        ...

    def received(self) -> None:
        """The move has filled the buffers."""
        ...


Message = torch.Tensor | shm.Parts  # a tensor over the group, or views through shared memory
BUCKET_BYTES = 32 * 2**20
DIRECT_BYTES = 2**20  # a slice this large travels alone, straight from/into the shard if it can


class TransferGroup:
    """A process group over ``size`` actors that meet through ``store`` (one of its own:
    ``rayhf.parallel.groups.host_store``). With ``same_host`` (and gloo), messages of
    ``shm_min_bytes`` or more between members that share this host's ``/dev/shm`` travel
    through it, or with ``ipc`` between members on one GPU through a segment on it."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        device: str = "cpu",
        shared_devices: bool = False,
        same_host: bool = True,
        shm_min_bytes: int = SHM_MIN_BYTES,
        ipc: bool = False,
        sharing: cuda_ipc.Sharing | None = None,
    ) -> None:
        """``sharing``: how GPU segments are made and opened (CUDA IPC unless a test says)."""
        self.rank, self.size = rank, size
        self.pg: Any
        # GPU tensors through host memory: the members share GPUs, so NCCL cannot join them
        self.staged = device.startswith("cuda") and shared_devices
        self.shm: shm.Segments | None = None
        self.local: set[int] = set()  # peers whose messages go through shared memory
        self.shm_min_bytes, self.shm_messages = shm_min_bytes, 0  # the latter: sent so far
        self.gpus: dict[int, str] = {}  # with ipc: each local member's GPU, when it has one
        self.ipc: cuda_ipc.DeviceSegments | None = None
        self.ipc_messages = 0  # sent through GPU segments so far
        if device.startswith("cuda") and not shared_devices:
            nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009 (CUDA builds only)
            self.pg = nccl(store, rank, size)
            return
        self.pg = dist.ProcessGroupGloo(store, rank, size, STORE_TIMEOUT)
        self._meet(store, same_host and shm.available())
        if ipc and self.shm is not None:
            if sharing is None and cuda_ipc.available(torch.device(device)):
                sharing = cuda_ipc.cuda_sharing(torch.device(device))
            self._meet_gpus(store, "" if sharing is None else sharing.gpu)
            if sharing is not None:
                self.ipc = cuda_ipc.DeviceSegments(self.shm.token, rank, store, sharing)

    def _meet_gpus(self, store: Any, gpu: str) -> None:
        """Which local members share this rank's GPU (each says which it has, or none)."""
        store.set(f"gpu/{self.rank}", gpu)
        for peer in sorted(self.local | {self.rank}):
            self.gpus[peer] = store.get(f"gpu/{peer}").decode()

    def same_gpu(self, a: int, b: int) -> bool:
        """Whether members ``a`` and ``b`` exchange messages through GPU segments."""
        return (
            self.ipc is not None and bool(self.gpus.get(a)) and self.gpus.get(a) == self.gpus.get(b)
        )

    def _segments(self, peer: int) -> shm.Segments:
        """Where this rank puts a message for ``peer`` (and reads one ``peer`` put)."""
        if self.same_gpu(self.rank, peer):
            assert self.ipc is not None
            return self.ipc
        assert self.shm is not None
        return self.shm

    def get(self, header: torch.Tensor, message: shm.Parts) -> None:
        """Copy out the message ``header`` locates: in its owner's GPU segment if the owner
        shares this rank's GPU, else in its shared-memory segment."""
        self._segments(int(header[0])).get(header, message)

    def passes_header(self, received: Any, message: Message, peer: int) -> bool:
        """Whether a relay of ``message`` (``received``: its receive, done) to ``peer`` sends
        only where it lies: ``peer`` reads it where its owner put it for this rank."""
        if not (isinstance(received, _FromSegment) and isinstance(message, shm.Parts)):
            return False
        owner = int(received.header[0])
        return self.same_gpu(owner, peer) == self.same_gpu(owner, self.rank)

    def _meet(self, store: Any, use_shm: bool) -> None:
        """Find the members that share this host's /dev/shm (every member says whether it
        uses it, so one that does not cannot leave the others waiting)."""
        if self.rank == 0:
            store.set("shm/token", uuid.uuid4().hex[:12])
        if not use_shm:
            store.set(f"shm/pid/{self.rank}", "0")
            return
        shm.sweep()
        segments = shm.Segments(store.get("shm/token").decode(), self.rank)
        store.set(f"shm/pid/{self.rank}", str(os.getpid()))  # after the marker exists
        for peer in range(self.size):
            pid = int(store.get(f"shm/pid/{peer}"))
            if peer != self.rank and pid and segments.meet(peer, pid):
                self.local.add(peer)
        self.shm = segments

    def shares(self, peer: int, n_bytes: int) -> bool:
        """Whether a bucket of ``n_bytes`` to or from ``peer`` goes through shared memory (then
        its messages are ``shm.Parts``; otherwise tensors, over the group)."""
        return peer in self.local and n_bytes >= self.shm_min_bytes

    def begin(self, outgoing: list[tuple[int, Message]]) -> None:
        """Start a move in which this rank sends these (peer, message)s."""
        sizes: dict[int, int] = {}  # id of the segments -> bytes this move puts there
        for peer, m in outgoing:
            if isinstance(m, shm.Parts):
                key = id(self._segments(peer))
                sizes[key] = sizes.get(key, 0) + shm.padded(m.nbytes)
        for segments in (self.shm, self.ipc):
            if segments is not None:
                segments.reserve(sizes.get(id(segments), 0))

    def isend(self, message: Message, peer: int, tag: int):
        if isinstance(message, shm.Parts):
            segments = self._segments(peer)
            if segments is self.ipc:
                self.ipc_messages += 1
            else:
                self.shm_messages += 1
            return self.pg.send([segments.put(message)], peer, tag)
        if self.staged and message.is_cuda:
            message = message.cpu()  # gloo's work keeps the host copy alive until it is sent
        return self.pg.send([message], peer, tag)

    def irecv(self, message: Message, peer: int, tag: int):
        if isinstance(message, shm.Parts):
            header = torch.empty(3, dtype=torch.int64)
            return _FromSegment(self.pg.recv([header], peer, tag), header, self, message)
        if not (self.staged and message.is_cuda):
            return self.pg.recv([message], peer, tag)
        host = torch.empty(message.shape, dtype=message.dtype, pin_memory=True)
        return _Staged(self.pg.recv([host], peer, tag), host, message)

    def forward(self, received: Any, message: Message, peer: int, tag: int):
        """Relay ``message``, which ``received`` (an ``irecv``'s work) brought, to ``peer``: a
        message that came through shared memory goes on as its header (``peer`` shares the
        owner's host: it shares this one; ``passes_header``)."""
        if self.passes_header(received, message, peer):
            return self.pg.send([received.header], peer, tag)
        return self.isend(message, peer, tag)

    def close(self) -> None:
        for segments in (self.shm, self.ipc):
            if segments is not None:
                segments.close()


class _Staged:
    """A receive into host memory that lands in its GPU tensor when waited for."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self) -> None:
        self.work.wait()
        self.target.copy_(self.host)


class _FromSegment:
    """A receive of where the message lies in a peer's segment: ``wait`` for that, ``land`` to
    copy it out (a relay passes the header on in between, so the next rank copies alongside)."""

    def __init__(
        self, work: Any, header: torch.Tensor, group: TransferGroup, target: shm.Parts
    ) -> None:
        self.work, self.header, self.group, self.target = work, header, group, target

    def wait(self) -> None:
        self.work.wait()

    def land(self) -> None:
        self.group.get(self.header, self.target)


def buckets(transfers: list[Transfer], bucket_bytes: int = BUCKET_BYTES) -> list[list[Transfer]]:
    """Small transfers grouped in order into buckets of at most ``bucket_bytes``; a transfer of
    ``DIRECT_BYTES`` or more is a bucket of its own (sent without packing when contiguous)."""
    out: list[list[Transfer]] = []
    size = bucket_bytes  # forces a new bucket for the first small transfer
    for t in transfers:
        if t.nbytes >= DIRECT_BYTES:
            out.append([t])
            size = bucket_bytes
            continue
        if size + t.nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(t)
        size += t.nbytes
    return out


def chunks(n_bytes: int, itemsize: int) -> list[tuple[int, int]]:
    """A bucket of ``n_bytes`` as the element ranges of its messages, each at most
    ``CHUNK_BYTES``: a relay forwards a message as soon as it has arrived."""
    n, step = n_bytes // itemsize, max(1, CHUNK_BYTES // itemsize)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def by_stream(transfers: list[Transfer]) -> dict[int, list[Transfer]]:
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        out.setdefault(t.stream, []).append(t)
    return out


def tag(stream: int, message: int) -> int:
    """The message's tag on its pair of ranks: the same on every hop of its stream."""
    assert stream < 2**15 and message < 2**16, "too many streams or messages for a tag"
    return stream << 16 | message


def _region(shard: torch.Tensor, t: Transfer, offset: int, first: int = 0) -> torch.Tensor:
    """``t``'s slice of ``shard``, its rows from ``offset`` (and its experts from ``first``); a
    dense shard of 3+ dims split along the first is seen as ``[rows, the rest]``, as a flat
    source's rectangles see it."""
    if t.experts is not None:
        shard = shard.narrow(0, first, t.experts[2])
    elif shard.dim() > 2 and t.dim == 0:
        shard = shard.view(shard.shape[0], -1)
    piece = shard.narrow(t.dim, offset, t.stop - t.start)
    if t.cross is not None:
        piece = piece.narrow(1 - t.dim, t.cross[0], t.cross[1] - t.cross[0])
    return piece


def src_piece(shards: Mapping[str, torch.Tensor], t: Transfer) -> torch.Tensor:
    """What the source sends of ``t``: rows of its shard, or a strided view of its flat slice."""
    if t.src_view is None:
        return _region(shards[t.name], t, t.src_offset, t.experts[0] if t.experts else 0)
    flat = shards[t.name]
    size, stride = t.src_view
    return flat.as_strided(size, stride, flat.storage_offset() + t.src_offset)


def dst_piece(shards: Mapping[str, torch.Tensor], t: Transfer) -> torch.Tensor:
    """Where the destination keeps ``t`` in its shard."""
    return _region(shards[t.name], t, t.dst_offset, t.experts[1] if t.experts else 0)


def _pack(pieces: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
    """A source bucket as one flat tensor (the shard's own memory when it can be)."""
    if dtype is not None and pieces[0].dtype != dtype:
        pieces = [piece.to(dtype) for piece in pieces]
    if len(pieces) == 1 and pieces[0].is_contiguous():
        return pieces[0].reshape(-1)  # no packing copy
    return torch.cat([piece.reshape(-1) for piece in pieces])


def _splittable(piece: torch.Tensor) -> bool:
    """Whether any range of ``piece``'s elements (in order) is a few views of it."""
    return piece.is_contiguous() or (piece.dim() == 2 and piece.stride(1) == 1)


def _range_views(piece: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    """Elements ``[lo, hi)`` of ``piece`` in row-major order, as at most 3 views of it."""
    if piece.is_contiguous():
        return [piece.reshape(-1)[lo:hi]]
    cols = piece.shape[1]
    (r0, c0), (r1, c1) = divmod(lo, cols), divmod(hi, cols)
    if r0 == r1:
        return [piece[r0, c0:c1]]
    views = [piece[r0, c0:]] if c0 else []
    r0 += 1 if c0 else 0
    views += [piece[r0:r1]] if r1 > r0 else []
    return views + ([piece[r1, :c1]] if c1 else [])


def _views(pieces: list[torch.Tensor], lo: int, hi: int) -> list[torch.Tensor]:
    """Elements ``[lo, hi)`` of the pieces laid end to end, as views of them."""
    out, start = [], 0
    for piece in pieces:
        end = start + piece.numel()
        if end > lo and start < hi:
            out += _range_views(piece, max(lo, start) - start, min(hi, end) - start)
        start = end
    return out


def _messages(
    pieces: list[torch.Tensor], dtype: torch.dtype, flat: torch.Tensor | None, shared: bool
) -> list[Message]:
    """A bucket's messages: views of its pieces through shared memory when it can be, else
    ranges of ``flat`` (its packed or landing tensor; through shared memory if ``shared``)."""
    n = sum(piece.numel() for piece in pieces)
    ranges = chunks(n * dtype.itemsize, dtype.itemsize)
    if flat is None:
        return [shm.Parts(_views(pieces, lo, hi), dtype) for lo, hi in ranges]
    return [shm.Parts([flat[lo:hi]], dtype) if shared else flat[lo:hi] for lo, hi in ranges]


def send_all(
    group: TransferGroup,
    shards: Mapping[str, torch.Tensor],
    by_peer: Mapping[int, list[Transfer]],
    bucket_bytes: int = BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> int:
    """Send this rank's source slices to each peer (cast to ``dtype``: the receivers'), message
    by message in the global order (message, stream); returns bytes sent. A bucket through
    shared memory is copied from the shards into the segment (cast on the way), unpacked."""
    outgoing: list[tuple[tuple[int, int], int, Message]] = []
    with torch.no_grad():
        for peer, transfers in sorted(by_peer.items()):
            for stream, mine in sorted(by_stream(transfers).items()):
                m = 0
                for bucket in buckets(mine, bucket_bytes):
                    pieces = [src_piece(shards, t) for t in bucket]
                    shared = group.shares(peer, sum(t.nbytes for t in bucket))
                    direct = shared and all(_splittable(piece) for piece in pieces)
                    flat = None if direct else _pack(pieces, dtype)
                    for msg in _messages(pieces, dtype or pieces[0].dtype, flat, shared):
                        outgoing.append(((m, stream), peer, msg))
                        m += 1
    outgoing.sort(key=lambda o: o[0])  # the global order: (message, stream)
    group.begin([(peer, msg) for _, peer, msg in outgoing])
    with torch.no_grad():
        works = [group.isend(msg, peer, tag(stream, m)) for (m, stream), peer, msg in outgoing]
    for w in works:
        w.wait()
    return sum(_nbytes(msg) for _, _, msg in outgoing)


def _nbytes(message: Message) -> int:
    if isinstance(message, shm.Parts):
        return message.nbytes
    return message.numel() * message.element_size()


Blend = Callable[[torch.Tensor, torch.Tensor], None]  # (destination slice, received) -> None


def copy_into(dst: torch.Tensor, received: torch.Tensor) -> None:
    dst.copy_(received)


def ema_into(eta: float) -> Blend:
    """``dst = eta * received + (1 - eta) * dst`` (a moving average toward the source)."""

    def blend(dst: torch.Tensor, received: torch.Tensor) -> None:
        dst.mul_(1.0 - eta).add_(received, alpha=eta)

    return blend


@dataclass
class _Bucket:
    """One incoming bucket: where it lands, what is in it, and its messages still to come."""

    flat: torch.Tensor | None  # the received bytes (the shard region itself when direct)
    transfers: list[Transfer]  # empty when received straight into the shard
    left: int
    n_bytes: int = 0


@dataclass
class _Incoming:
    key: tuple[int, int]  # (message, stream)
    peer: int
    message: Message
    bucket: _Bucket


def recv_all(
    group: TransferGroup,
    shards: Mapping[str, torch.Tensor],
    by_peer: Mapping[int, list[Transfer]],
    blend: Blend = copy_into,
    bucket_bytes: int = BUCKET_BYTES,
    forward: Mapping[int, list[Transfer]] | None = None,
) -> int:
    """Receive this rank's destination slices from each peer into ``shards`` and forward each
    message of a relayed stream to the next ranks (``forward``: peer -> the relay transfers,
    the same slices in the same order) as soon as it arrives; returns bytes received.

    Every rank posts, takes and sends its messages in one global order, (message, stream), and
    forwards each when it arrives, so no rank waits on a message whose sending waits on it, and
    every pair of ranks sees its messages in the same order on both sides (NCCL matches
    point-to-point messages by order, not by tag)."""
    downstream: dict[int, list[int]] = {}
    for peer, transfers in sorted((forward or {}).items()):
        for stream in by_stream(transfers):
            downstream.setdefault(stream, []).append(peer)
    incoming: list[_Incoming] = []
    for peer, transfers in sorted(by_peer.items()):
        for stream, mine in by_stream(transfers).items():
            onward = downstream.get(stream, [])
            m = 0
            for bucket in buckets(mine, bucket_bytes):
                landing, messages = _landing(group, shards, bucket, blend, peer, onward)
                landing.left = len(messages)
                for msg in messages:
                    incoming.append(_Incoming((m, stream), peer, msg, landing))
                    m += 1
    incoming.sort(key=lambda i: i.key)  # posted in the order they are sent: NCCL has no tags
    relays_of = [[(p, _onward(group, i, p)) for p in downstream.get(i.key[1], [])]
                 for i in incoming]  # fmt: skip
    group.begin([relay for relays in relays_of for relay in relays])
    pending = [(i, group.irecv(i.message, i.peer, tag(i.key[1], i.key[0]))) for i in incoming]
    sends, received = [], 0
    with torch.no_grad():
        for (i, work), relays in zip(pending, relays_of, strict=True):
            work.wait()
            (m, stream), landing = i.key, i.bucket
            # what only passes a header on need not wait for this rank's own copy
            later = isinstance(work, _FromSegment) and all(
                group.passes_header(work, msg, p) for p, msg in relays
            )
            if isinstance(work, _FromSegment) and not later:
                work.land()
            sends += [group.forward(work, msg, p, tag(stream, m)) for p, msg in relays]
            if later:
                work.land()
            received += _nbytes(i.message)
            landing.left -= 1
            if landing.left == 0:
                _unpack(shards, landing, blend)
        for w in sends:
            w.wait()
    return received


def _onward(group: TransferGroup, i: _Incoming, peer: int) -> Message:
    """What of the message ``i`` goes on to ``peer``: views through shared memory if the peer
    shares them, else the received tensor."""
    if not group.shares(peer, i.bucket.n_bytes):
        assert not isinstance(i.message, shm.Parts) or len(i.message.views) == 1
        return i.message.views[0] if isinstance(i.message, shm.Parts) else i.message
    return (
        i.message if isinstance(i.message, shm.Parts) else shm.Parts([i.message], i.message.dtype)
    )


def _landing(
    group: TransferGroup,
    shards: Mapping[str, torch.Tensor],
    bucket: list[Transfer],
    blend: Blend,
    peer: int,
    onward: list[int],
) -> tuple[_Bucket, list[Message]]:
    """Where an incoming bucket lands, and its messages: through shared memory straight into
    the shards when it copies and every next rank of a relay shares the memory too; else into
    the shard itself when it is one contiguous slice, or a buffer to unpack."""
    pieces = [dst_piece(shards, t) for t in bucket]
    n_bytes = sum(t.nbytes for t in bucket)
    shared = group.shares(peer, n_bytes)
    onward_shared = all(group.shares(p, n_bytes) for p in onward)
    if shared and onward_shared and blend is copy_into and all(map(_splittable, pieces)):
        return _Bucket(None, [], 0, n_bytes), _messages(pieces, pieces[0].dtype, None, True)
    first = pieces[0]
    if blend is copy_into and len(bucket) == 1 and first.is_contiguous():
        flat = first.detach().reshape(-1)  # straight into the shard's memory
        landing = _Bucket(flat, [], 0, n_bytes)
    else:
        flat = torch.empty(sum(p.numel() for p in pieces), dtype=first.dtype, device=first.device)
        landing = _Bucket(flat, bucket, 0, n_bytes)
    return landing, _messages(pieces, first.dtype, flat, shared)


def _unpack(shards: Mapping[str, torch.Tensor], landing: _Bucket, blend: Blend) -> None:
    offset = 0
    for t in landing.transfers:
        assert landing.flat is not None
        dst = dst_piece(shards, t)
        blend(dst, landing.flat[offset : offset + dst.numel()].view_as(dst))
        offset += dst.numel()


def send_from(
    group: TransferGroup,
    source: ShardSource,
    by_peer: Mapping[int, list[Transfer]],
    dtype: torch.dtype | None = None,
):
    """A rank's sending side of a move (in ``dtype``: the receivers'); returns bytes sent."""
    return send_all(group, source.source_shards(), by_peer, dtype=dtype)


def receive_into(
    group: TransferGroup,
    sink: ShardSink,
    by_peer: Mapping[int, list[Transfer]],
    blend: Blend = copy_into,
    forward: Mapping[int, list[Transfer]] | None = None,
) -> int:
    """A rank's receiving side of a move (copy, or ``blend``; relaying what ``forward``
    names); returns bytes received."""
    received = recv_all(group, sink.receive_buffers(), by_peer, blend, forward=forward)
    sink.received()
    return received
