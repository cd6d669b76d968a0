"""Same-host messages of a transfer group through shared memory: the sender copies a message
into its own segment (a file in ``/dev/shm``) and sends its peer only where it lies; the peer
copies it out. Two memory copies a message, and no socket.

    sender:   segment[offset:] <- message;  send (owner, generation, offset)   over the group
    receiver: recv (owner, generation, offset);  buffer <- owner's segment[offset:]
    relay:    forwards the header it received, not the bytes: the next rank reads the owner's

So a message that a relay chain carries to n ranks of one host costs n + 1 copies, as a
broadcast would. A segment holds one move's outgoing messages (``reserve`` at the start of
every move: the driver starts a move only when the last one has ended, so nothing still reads
the old bytes). Which peers share this host is found by looking, not assumed: each member
creates a marker file, and a peer whose marker is visible shares this ``/dev/shm``. Segments
carry their owner's pid; a member sweeps the segments of owners that died without cleaning up
(a killed actor).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
PREFIX = "rayhf-xfer-"
ALIGN = 64


@dataclass
class Parts:
    """A message as the views of tensors it is read from or written to, in order (a range of
    a bucket of shard slices), so it is copied straight between them and a segment."""

    views: list[torch.Tensor]
    dtype: torch.dtype  # what it travels in (a view in another dtype is cast)

    @property
    def nbytes(self) -> int:
        return sum(v.numel() for v in self.views) * self.dtype.itemsize


def available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


def _path(token: str, rank: int, pid: int, generation: int) -> Path:
    return SHM_DIR / f"{PREFIX}{token}-r{rank}-p{pid}-g{generation}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep() -> int:
    """Remove the segments whose owner process is gone; returns how many."""
    removed = 0
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        pid = next((p[1:] for p in path.name.split("-") if p[:1] == "p" and p[1:].isdigit()), "")
        if pid and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed += 1
    return removed


def _unlink(paths: list[Path]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


class Segments:
    """This rank's outgoing segment in one transfer group, and its peers' that it reads."""

    def __init__(self, token: str, rank: int, marker: bool = True) -> None:
        """``marker``: leave the file by which peers on this host find this rank."""
        self.token, self.rank, self.pid = token, rank, os.getpid()
        self.marker = _path(token, rank, self.pid, 0)
        if marker:
            self.marker.touch()
        self._owned = [self.marker] if marker else []
        self._finalizer = weakref.finalize(self, _unlink, self._owned)
        self.generation, self.offset = 0, 0
        self.segment = torch.empty(0, dtype=torch.uint8)
        self._peers: dict[tuple[int, int], torch.Tensor] = {}  # (peer, generation) -> segment
        self._pids: dict[int, int] = {}

    def meet(self, peer: int, pid: int) -> bool:
        """Whether ``peer`` (process ``pid``) shares this host's ``/dev/shm``."""
        if _path(self.token, peer, pid, 0).exists():
            self._pids[peer] = pid
            return True
        return False

    def reserve(self, n_bytes: int) -> None:
        """Start a move that sends ``n_bytes`` (each message padded to ``ALIGN``) from here."""
        self.offset = 0
        if n_bytes <= self.segment.numel():
            return
        self.generation += 1
        self.segment = self._allocate(n_bytes)
        if self.generation > 1:
            self._retire(self.generation - 1)

    def put(self, message: Parts) -> torch.Tensor:
        """Copy ``message`` into the segment; returns the header its peer needs to find it."""
        n = message.nbytes
        assert self.offset + n <= self.segment.numel(), "a move sends more than it reserved"
        self._copy(self.segment, self.offset, message, out=False)
        self._written()
        header = torch.tensor([self.rank, self.generation, self.offset], dtype=torch.int64)
        self.offset += padded(n)
        return header

    def get(self, header: torch.Tensor, message: Parts) -> None:
        """Copy the message ``header`` locates (in a peer's segment) into ``message``'s views."""
        owner, generation, offset = (int(v) for v in header.tolist())
        key = (owner, generation)
        if key not in self._peers:
            for old in [k for k in self._peers if k[0] == owner]:
                del self._peers[old]
            self._peers[key] = self._open(owner, generation)
        self._copy(self._peers[key], offset, message, out=True)
        self._read()

    # Where segments live: files in /dev/shm here; ``rayhf.realloc.cuda_ipc`` keeps them on a GPU.

    def _allocate(self, n_bytes: int) -> torch.Tensor:
        """This rank's segment of the current generation."""
        path = _path(self.token, self.rank, self.pid, self.generation)
        self._owned.append(path)
        return torch.from_file(str(path), shared=True, size=n_bytes, dtype=torch.uint8)

    def _retire(self, generation: int) -> None:
        """Drop this rank's segment of an older generation."""
        old = _path(self.token, self.rank, self.pid, generation)
        _unlink([old])
        self._owned.remove(old)

    def _open(self, owner: int, generation: int) -> torch.Tensor:
        """A peer's segment of ``generation``."""
        path = _path(self.token, owner, self._pids[owner], generation)
        size = path.stat().st_size
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def _written(self) -> None:
        """A message is in the segment: its peer may read it once the header is sent."""

    def _read(self) -> None:
        """A message is out of a peer's segment: its owner may overwrite it next move."""

    @staticmethod
    def _copy(segment: torch.Tensor, offset: int, message: Parts, out: bool) -> None:
        itemsize = message.dtype.itemsize
        for v in message.views:
            n = v.numel() * itemsize
            region = segment[offset : offset + n].view(message.dtype).view(v.shape)
            if out:
                v.copy_(region)
            else:
                region.copy_(v)
            offset += n

    def close(self) -> None:
        self._finalizer()


def padded(n_bytes: int) -> int:
    return -(-n_bytes // ALIGN) * ALIGN
