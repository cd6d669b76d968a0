"""Moving planned slices between processes: point-to-point over a process group of the actors
involved, bucketed, inside each actor. No Ray here; the driver side is ``mover.py``.

A ``TransferGroup`` is an independent torch process group (gloo for CPU tensors, NCCL for GPU
tensors) over one set of actors, made from its own TCP store, so an actor can belong to its role
group's dp/tp/pp world and to any number of transfer groups at once. NCCL refuses a communicator
with two ranks on one GPU ("Duplicate GPU detected"), which is what role groups colocated on the
same GPUs are: their groups run gloo, each GPU slice staged through host memory. (Ray's
``ray.util.collective`` gloo groups reuse the process's default torch world, which our actors
already own for their layout; see docs/decisions.md.)

Both sides of a hop walk the same transfers of a stream in the same order, so they cut the same
buckets (at most ``bucket_bytes``) and the same messages (at most ``CHUNK_BYTES`` of a bucket);
every hop of a stream carries the same slices, so a rank that relays forwards each message it
received, unchanged, to the stream's next ranks as soon as it has arrived (a pipeline).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rayhf.realloc.plan import CHUNK_BYTES, Transfer


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


BUCKET_BYTES = 32 * 2**20
DIRECT_BYTES = 2**20  # a slice this large travels alone, straight from/into the shard if it can


class TransferGroup:
    """A process group over ``size`` actors; rank 0 hosts the store at ``address``."""

    def __init__(
        self, address: str, rank: int, size: int, device: str = "cpu", shared_devices: bool = False
    ) -> None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        timeout = datetime.timedelta(seconds=300)
        store = dist.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
        self.rank, self.size = rank, size
        self.pg: Any
        # GPU tensors through host memory: the members share GPUs, so NCCL cannot join them
        self.staged = device.startswith("cuda") and shared_devices
        if device.startswith("cuda") and not shared_devices:
            nccl: Any = getattr(dist, "ProcessGroupNCCL")  # noqa: B009 (CUDA builds only)
            self.pg = nccl(store, rank, size)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def isend(self, t: torch.Tensor, peer: int, tag: int):
        if self.staged and t.is_cuda:
            t = t.cpu()  # gloo's work keeps the host copy alive until it is sent
        return self.pg.send([t], peer, tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int):
        if not (self.staged and t.is_cuda):
            return self.pg.recv([t], peer, tag)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return _Staged(self.pg.recv([host], peer, tag), host, t)


class _Staged:
    """A receive into host memory that lands in its GPU tensor when waited for."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target

    def wait(self) -> None:
        self.work.wait()
        self.target.copy_(self.host)


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


def _region(shard: torch.Tensor, t: Transfer, offset: int) -> torch.Tensor:
    piece = shard.narrow(t.dim, offset, t.stop - t.start)
    if t.cross is not None:
        piece = piece.narrow(1 - t.dim, t.cross[0], t.cross[1] - t.cross[0])
    return piece


def src_piece(shards: Mapping[str, torch.Tensor], t: Transfer) -> torch.Tensor:
    """What the source sends of ``t``: rows of its shard, or a strided view of its flat slice."""
    if t.src_view is None:
        return _region(shards[t.name], t, t.src_offset)
    flat = shards[t.name]
    size, stride = t.src_view
    return flat.as_strided(size, stride, flat.storage_offset() + t.src_offset)


def dst_piece(shards: Mapping[str, torch.Tensor], t: Transfer) -> torch.Tensor:
    """Where the destination keeps ``t`` in its shard."""
    return _region(shards[t.name], t, t.dst_offset)


def _pack(
    shards: Mapping[str, torch.Tensor], bucket: list[Transfer], dtype: torch.dtype | None
) -> torch.Tensor:
    """A source bucket as one flat tensor (the shard's own memory when it can be)."""
    pieces = [src_piece(shards, t) for t in bucket]
    if dtype is not None and pieces[0].dtype != dtype:
        pieces = [piece.to(dtype) for piece in pieces]
    if len(pieces) == 1 and pieces[0].is_contiguous():
        return pieces[0].reshape(-1)  # no packing copy
    return torch.cat([piece.reshape(-1) for piece in pieces])


def send_all(
    group: TransferGroup,
    shards: Mapping[str, torch.Tensor],
    by_peer: Mapping[int, list[Transfer]],
    bucket_bytes: int = BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> int:
    """Send this rank's source slices to each peer (cast to ``dtype``: the receivers'), message
    by message in the global order (message, stream); returns bytes sent."""
    outgoing: list[tuple[tuple[int, int], int, torch.Tensor]] = []
    sent = 0
    with torch.no_grad():
        for peer, transfers in sorted(by_peer.items()):
            for stream, mine in sorted(by_stream(transfers).items()):
                m = 0
                for bucket in buckets(mine, bucket_bytes):
                    flat = _pack(shards, bucket, dtype)
                    for lo, hi in chunks(flat.numel() * flat.element_size(), flat.element_size()):
                        outgoing.append(((m, stream), peer, flat[lo:hi]))
                        m += 1
                    sent += flat.numel() * flat.element_size()
    outgoing.sort(key=lambda o: o[0])  # the global order: (message, stream)
    works = [group.isend(t, peer, tag(stream, m)) for (m, stream), peer, t in outgoing]
    for w in works:
        w.wait()
    return sent


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

    flat: torch.Tensor  # the received bytes (the shard region itself when direct)
    transfers: list[Transfer]  # empty when received straight into the shard
    left: int


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
    incoming: list[tuple[tuple[int, int], int, torch.Tensor, _Bucket]] = []
    for peer, transfers in sorted(by_peer.items()):
        for stream, mine in by_stream(transfers).items():
            m = 0
            for bucket in buckets(mine, bucket_bytes):
                landing = _landing(shards, bucket, blend is copy_into)
                pieces = chunks(landing.flat.numel() * landing.flat.element_size(),
                                landing.flat.element_size())  # fmt: skip
                landing.left = len(pieces)
                for lo, hi in pieces:
                    view = landing.flat[lo:hi]
                    incoming.append(((m, stream), peer, view, landing))
                    m += 1
    incoming.sort(key=lambda i: i[0])  # posted in the order they are sent: NCCL has no tags
    pending = [(key, group.irecv(view, peer, tag(key[1], key[0])), view, b)
               for key, peer, view, b in incoming]  # fmt: skip
    sends, received = [], 0
    with torch.no_grad():
        for (m, stream), work, view, landing in pending:
            work.wait()
            sends += [group.isend(view, p, tag(stream, m)) for p in downstream.get(stream, [])]
            received += view.numel() * view.element_size()
            landing.left -= 1
            if landing.left == 0:
                _unpack(shards, landing, blend)
        for w in sends:
            w.wait()
    return received


def _landing(shards: Mapping[str, torch.Tensor], bucket: list[Transfer], direct: bool) -> _Bucket:
    first = dst_piece(shards, bucket[0])
    if direct and len(bucket) == 1 and first.is_contiguous():
        return _Bucket(first.detach().reshape(-1), [], 0)  # straight into the shard's memory
    n = sum(dst_piece(shards, t).numel() for t in bucket)
    return _Bucket(torch.empty(n, dtype=first.dtype, device=first.device), bucket, 0)


def _unpack(shards: Mapping[str, torch.Tensor], landing: _Bucket, blend: Blend) -> None:
    offset = 0
    for t in landing.transfers:
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
