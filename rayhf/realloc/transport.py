"""Moving planned slices between processes: point-to-point over a process group of the actors
involved, bucketed, inside each actor. No Ray here; the driver side is ``mover.py``.

A ``TransferGroup`` is an independent torch process group (gloo for CPU tensors, NCCL for GPU
tensors) over one set of actors, made from its own TCP store, so an actor can belong to its role
group's dp/tp/pp world and to any number of transfer groups at once. NCCL refuses a communicator
with two ranks on one GPU ("Duplicate GPU detected"), which is what role groups colocated on the
same GPUs are: their groups run gloo, each GPU slice staged through host memory. (Ray's
``ray.util.collective`` gloo groups reuse the process's default torch world, which our actors
already own for their layout; see docs/decisions.md.)

Both sides walk the same transfer list in the same order, so they cut the same buckets: every
(sender, receiver) pair exchanges one message per bucket of at most ``bucket_bytes``.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from rayhf.realloc.plan import Transfer


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


def send_all(
    group: TransferGroup,
    shards: Mapping[str, torch.Tensor],
    by_peer: Mapping[int, list[Transfer]],
    bucket_bytes: int = BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> int:
    """Send this rank's source slices to each peer (cast to ``dtype``: the receivers'); returns
    bytes sent."""
    works, sent = [], 0
    with torch.no_grad():
        for peer, transfers in sorted(by_peer.items()):
            for tag, bucket in enumerate(buckets(transfers, bucket_bytes)):
                pieces = [src_piece(shards, t) for t in bucket]
                if dtype is not None and pieces[0].dtype != dtype:
                    pieces = [piece.to(dtype) for piece in pieces]
                if len(pieces) == 1 and pieces[0].is_contiguous():
                    flat = pieces[0]  # no packing copy
                else:
                    flat = torch.cat([piece.reshape(-1) for piece in pieces])
                works.append(group.isend(flat, peer, tag))
                sent += flat.numel() * flat.element_size()
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


def recv_all(
    group: TransferGroup,
    shards: Mapping[str, torch.Tensor],
    by_peer: Mapping[int, list[Transfer]],
    blend: Blend = copy_into,
    bucket_bytes: int = BUCKET_BYTES,
) -> int:
    """Receive this rank's destination slices from each peer into ``shards``; returns bytes."""
    pending: list[tuple[Any, torch.Tensor, list[Transfer]]] = []
    direct_ok = blend is copy_into
    for peer, transfers in sorted(by_peer.items()):
        for tag, bucket in enumerate(buckets(transfers, bucket_bytes)):
            first = dst_piece(shards, bucket[0])
            if direct_ok and len(bucket) == 1 and first.is_contiguous():
                # Straight into the shard's memory: nothing left to do after the wait.
                pending.append((group.irecv(first.detach(), peer, tag), first, []))
                continue
            n = sum(dst_piece(shards, t).numel() for t in bucket)
            flat = torch.empty(n, dtype=first.dtype, device=first.device)
            pending.append((group.irecv(flat, peer, tag), flat, bucket))
    received = 0
    with torch.no_grad():
        for work, flat, bucket in pending:
            work.wait()
            received += flat.numel() * flat.element_size()
            offset = 0
            for t in bucket:
                dst = dst_piece(shards, t)
                blend(dst, flat[offset : offset + dst.numel()].view_as(dst))
                offset += dst.numel()
    return received


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
) -> int:
    """A rank's receiving side of a move (copy, or ``blend``); returns bytes received."""
    received = recv_all(group, sink.receive_buffers(), by_peer, blend)
    sink.received()
    return received
