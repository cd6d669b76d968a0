"""The first thing a rayhf process imports: Python's cyclic garbage collector paused while the
package's imports load (torch, transformers, pydantic, Ray: some 200,000 objects that live as
long as the process), then those objects frozen out of its walks (``gc.freeze``).

Without it, every full collection walks them again: while they load, and at each later one in
the driver and in every actor. A two-step PPO run of the tiny example spent 22% less CPU with
it (docs/decisions/0101-*). What it costs: the few thousand objects the imports leave as
garbage in cycles (8,435, in a process that holds 270 MB) are never freed. ``RAYHF_GC_FREEZE=0``
leaves the collector alone (benchmarks/startup_gc.py measures both).
"""

from __future__ import annotations

import gc
import os

_FREEZES = os.environ.get("RAYHF_GC_FREEZE", "1") != "0"
_COLLECTING = gc.isenabled()
if _FREEZES:
    gc.disable()


def imported() -> None:
    """Freeze what the imports made and let the collector run again (if it ran before)."""
    if _FREEZES:
        gc.freeze()
        if _COLLECTING:
            gc.enable()
