"""SIGTERM as a pod eviction: checkpoint at the next step boundary, then stop.

    SIGTERM -> ``requested`` (the step loop stops submitting, collects what runs, checkpoints)
            -> no step boundary within ``grace_s``: Ctrl-C's path (``KeyboardInterrupt`` in the
               main thread: the run stops with its last complete checkpoint)

Installed only around the step loop, in the main thread (``ray.init`` installs its own SIGTERM
handler, which this one replaces for that time).
"""

from __future__ import annotations

import _thread
import signal
import threading
import time
from types import FrameType, TracebackType


class Preemption:
    """A context manager that turns SIGTERM into a request to stop at a step boundary."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.requested_at: float | None = None  # time.monotonic() of the SIGTERM
        self._previous: object = None
        self._timer: threading.Timer | None = None
        self._installed = False

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.requested_at is not None:
            return
        self.requested_at = time.monotonic()
        self._timer = threading.Timer(self.grace_s, _thread.interrupt_main)
        self._timer.daemon = True
        self._timer.start()
