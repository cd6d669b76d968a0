"""The cgroups of one sandboxed run: made under the worker's own cgroup (so the worker's limits
still hold above them), the run's first process moved in before it execs, every process in them
killed at the end.

cgroup v1 (a hierarchy per controller, as on this machine) gives a directory per controller;
cgroup v2 one directory, whose ``pids``, ``memory`` and ``cpu`` files exist only where the
worker's cgroup delegates those controllers to its children (``cgroup.subtree_control``). A
controller this process may not use is left out: the sandbox's rlimits stand in, and
``controllers()`` says which hold.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "memory", "cpu")
# How long ``end`` keeps killing what is left before it gives up on the directory.
END_SECONDS = 2.0


@dataclass
class RunCgroups:
    """A run's cgroup directories and the controllers whose limits they hold."""

    dirs: list[Path]
    controllers: frozenset[str]

    @classmethod
    def make(cls, name: str, values: dict[str, str]) -> RunCgroups:
        """A cgroup ``name`` under each of the worker's own that it may write, with ``values``
        (file -> value; a file that is not there is skipped, so v1 and v2 names may mix)."""
        dirs, controllers = [], set()
        for base in own_cgroups():
            path = base / name
            try:
                path.mkdir()
            except OSError:
                continue
            wrote = {f.split(".")[0] for f, v in values.items() if _write(path / f, v)}
            if wrote:
                dirs.append(path)
                controllers |= wrote
            else:
                _remove(path)
        return cls(dirs, frozenset(controllers & set(CONTROLLERS)))

    def join(self, pid: int) -> None:
        """Move process ``pid`` in (before it starts anything)."""
        for path in self.dirs:
            (path / "cgroup.procs").write_text(str(pid))

    def oom_kills(self) -> int:
        """Processes the memory limit killed so far (read before ``end``)."""
        kills = 0
        for path in self.dirs:
            for name in ("memory.events", "memory.oom_control"):  # v2, v1
                with contextlib.suppress(OSError, ValueError):
                    for line in (path / name).read_text().splitlines():
                        if line.startswith("oom_kill "):
                            kills += int(line.split()[1])
        return kills

    def end(self) -> None:
        """Kill everything in the run's cgroups, then remove them."""
        for path in self.dirs:
            _write(path / "cgroup.kill", "1")  # v2, kernel 5.14+: the whole tree at once
            deadline = time.monotonic() + END_SECONDS
            while (pids := _pids_in(path)) and time.monotonic() < deadline:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.005)
            _remove(path)

    def __enter__(self) -> RunCgroups:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()


def own_cgroups() -> list[Path]:
    """This process's own cgroup directories that a run's may sit under and that it may write:
    the pids, memory and cpu hierarchies on cgroup v1, the one directory on v2."""
    own = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, names, rel = line.split(":", 2)
            if not names and (CGROUP_ROOT / "cgroup.controllers").exists():
                own.append(CGROUP_ROOT / rel.lstrip("/"))
            for c in set(names.split(",")) & set(CONTROLLERS):
                own.append(CGROUP_ROOT / c / rel.lstrip("/"))
    return [p for p in own if os.access(p, os.W_OK)]


def tasks_of(uid: int) -> int:
    """Processes and threads ``uid`` runs now (what RLIMIT_NPROC counts)."""
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, StopIteration, ValueError):
            lines = status.read_text().splitlines()
            if int(next(x for x in lines if x.startswith("Uid:")).split()[1]) == uid:
                n += int(next(x for x in lines if x.startswith("Threads:")).split()[1])
    return n


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.rmdir()


def _pids_in(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []
