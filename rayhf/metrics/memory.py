"""A call's peak memory on its device, as a rank measures it around the call.

On a GPU, CUDA's caching allocator's peak (``torch.cuda.max_memory_allocated``, reset before the
call). On an emulated device, a process of its own: the process's peak resident set since the
call began (Linux's ``VmHWM``, reset by writing 5 to ``/proc/self/clear_refs``), which counts
the interpreter, the libraries and the weights too. Where neither can be read, nothing.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    """Start measuring a peak here."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # not Linux, or not allowed: ``peak_bytes`` then reads the process's lifetime peak
    with contextlib.suppress(OSError):
        _CLEAR.write_text("5")


def peak_bytes(device: torch.device) -> int:
    """The peak since ``reset_peak`` (0: cannot be read here)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        found = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        return 0
    return int(found.group(1)) * 1024 if found else 0
