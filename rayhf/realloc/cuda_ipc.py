"""Same-GPU messages of a transfer group through CUDA IPC: the shared-memory protocol of
``shm.py`` with each rank's segment a buffer on its GPU.

Role groups colocated on one GPU are separate processes that NCCL will not join ("Duplicate GPU
detected"), so their moves went GPU -> /dev/shm -> GPU, two copies over PCIe. Here a peer on the
same GPU opens the sender's segment by its CUDA IPC handle (torch's ``reduce_tensor``, what verl
does to hand weights to its colocated vLLM) and copies out of it in device memory:

    sender:   segment[offset:] <- message; stream sync; send (owner, generation, offset)
    receiver: recv the header; open the owner's segment (its handle is in the group's store,
              once per generation); buffer <- segment[offset:]; stream sync

The syncs keep the protocol's promise: a header goes out only when its bytes are in place, and a
move ends only when every reader is done with them. Which peers share a GPU is looked up, not
assumed: each rank writes its device's UUID into the store.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rayhf.realloc.shm import Segments


def available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def device_id(device: torch.device) -> str:
    """What names this GPU across processes (their device indices may differ)."""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class Sharing:
    """How a segment is made and opened in another process (CUDA IPC; tests pass their own)."""

    gpu: str  # which device this process's segments live on: peers on the same one share them
    new: Callable[[int], torch.Tensor]  # a segment of n bytes
    export: Callable[[torch.Tensor], bytes]  # its handle
    open: Callable[[bytes], torch.Tensor]  # a peer's segment from its handle
    sync: Callable[[], None]  # the device has done this process's copies


def cuda_sharing(device: torch.device) -> Sharing:
    from torch.multiprocessing.reductions import reduce_tensor

    if device.index is None:  # "cuda": this process's current GPU
        device = torch.device("cuda", torch.cuda.current_device())

    def export(t: torch.Tensor) -> bytes:
        return pickle.dumps(reduce_tensor(t))

    def open_(blob: bytes) -> torch.Tensor:
        rebuild, args = pickle.loads(blob)
        args = list(args)
        args[6] = device.index  # the storage's device, as this process numbers it
        return rebuild(*args)

    return Sharing(
        gpu=device_id(device),
        new=lambda n: torch.empty(n, dtype=torch.uint8, device=device),
        export=export,
        open=open_,
        sync=lambda: torch.cuda.current_stream(device).synchronize(),
    )


class DeviceSegments(Segments):
    """This rank's outgoing segment on its GPU, and the segments it opens of peers on the same
    GPU; handles travel through ``store`` (the transfer group's)."""

    def __init__(self, token: str, rank: int, store: Any, sharing: Sharing) -> None:
        super().__init__(token, rank, marker=False)
        self.store, self.sharing = store, sharing

    def _key(self, owner: int, generation: int) -> str:
        return f"ipc/{self.token}/{owner}/{generation}"

    def _allocate(self, n_bytes: int) -> torch.Tensor:
        segment = self.sharing.new(n_bytes)
        self.store.set(self._key(self.rank, self.generation), self.sharing.export(segment))
        return segment

    def _retire(self, generation: int) -> None:
        """Nothing to do: the old buffer goes with its last reference (torch keeps memory a peer
        still has open until it lets go)."""

    def _open(self, owner: int, generation: int) -> torch.Tensor:
        return self.sharing.open(self.store.get(self._key(owner, generation)))

    def _written(self) -> None:
        self.sharing.sync()

    def _read(self) -> None:
        self.sharing.sync()
