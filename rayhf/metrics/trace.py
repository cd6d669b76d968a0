"""A run's timeline as a Chrome trace: every call and weight move of every step, one track per
role group, written to ``run_dir/trace.json`` as the step ends (open it in ui.perfetto.dev or
chrome://tracing).

The file is the Trace Event Format's JSON array form, which readers accept without its closing
``]``, so events are appended as they happen and a resumed run adds to the same file. Each event
is a complete event (``"ph": "X"``) whose ``args`` carry the step, the role and the layout (a
move: ``src -> dst``) plus what the driver measured (bytes moved). At the end of a run Ray's own
task events (``ray.timeline()``) are added as a second process, so each call's span lines up with
the actor tasks, argument transfers and output stores under it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_FILE = "trace.json"
PID = 0  # one process in the trace: the driver's view of the run


@dataclass(frozen=True)
class TraceSpan:
    """One call or weight move of a step, in wall-clock seconds (``time.time()``)."""

    name: str  # the call, or ``realloc:<call>`` / ``ema:<role>``
    kind: str  # "call" or "realloc"
    role: str
    layout: str  # the layout it ran in; a move: "src -> dst"
    track: str  # the role group whose devices it occupies: "role.layout"
    start: float
    end: float
    args: dict[str, Any] = field(default_factory=dict)


class TraceWriter:
    """Appends spans to ``path``; ``step`` and ``phase`` ("train" or "eval") go in their args."""

    def __init__(self, path: Path) -> None:
        self.tracks: dict[str, int] = {}
        if path.exists() and path.stat().st_size:
            for event in read_trace(path):  # a resumed run keeps its tracks
                if event.get("name") == "thread_name":
                    self.tracks[event["args"]["name"]] = event["tid"]
            self._file = path.open("a")
        else:
            self._file = path.open("w")
            self._file.write("[\n")
            self._emit({"name": "process_name", "ph": "M", "pid": PID, "args": {"name": "rayhf"}})

    def write(self, step: int, spans: list[TraceSpan], phase: str = "train") -> None:
        for s in spans:
            event = {
                "name": s.name,
                "cat": s.kind,
                "ph": "X",
                "ts": s.start * 1e6,
                "dur": max(s.end - s.start, 0.0) * 1e6,
                "pid": PID,
                "tid": self._track(s.track),
                "args": {
                    "step": step,
                    "phase": phase,
                    "role": s.role,
                    "layout": s.layout,
                    **s.args,
                },
            }
            self._emit(event)
        self._file.flush()

    def write_ray_events(self, events: list[dict[str, Any]], since: float) -> int:
        """Add Ray's own task events (``ray.timeline()``: every actor task's execution, argument
        deserialization and output storing, per worker) from ``since`` (``time.time()``) on,
        as one more process in the trace; returns how many were added."""
        kept = [e for e in events if e.get("ph") == "X" and e.get("ts", 0) >= since * 1e6]
        for e in kept:
            self._emit({**e, "pid": f"ray {e.get('pid', '')}".strip()})
        self._file.flush()
        return len(kept)

    def close(self) -> None:
        self._file.close()

    def _track(self, name: str) -> int:
        if name not in self.tracks:
            self.tracks[name] = len(self.tracks) + 1
            meta = {"name": "thread_name", "ph": "M", "pid": PID, "tid": self.tracks[name]}
            self._emit({**meta, "args": {"name": name}})
        return self.tracks[name]

    def _emit(self, event: dict[str, Any]) -> None:
        self._file.write(json.dumps(event) + ",\n")


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The events of a trace file this module wrote (the array form, closing ``]`` optional)."""
    text = path.read_text().rstrip().removesuffix(",")
    return json.loads(text if text.endswith("]") else text + "\n]")
