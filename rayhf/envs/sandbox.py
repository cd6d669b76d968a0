"""The sandboxed code runner: a model's Python program in a child process with limits, its
stdout, stderr and exit code returned as what the tool says back.

The child runs in a temporary directory of its own with an empty environment and:

- a process cap: a pids cgroup of its own where this process may make one (``pids.max``; root
  in a container, as here, is exempt from ``RLIMIT_NPROC``), else ``RLIMIT_NPROC`` counted over
  what this user already runs; at the end every process in the cgroup (or the process group) is
  killed, so nothing it started outlives it;
- ``setrlimit`` limits on CPU seconds, address space and file size, and a wall-clock limit kept
  by the parent;
- no network device, where the kernel lets it make a user and a network namespace;
- a prelude that installs an audit hook, which the program cannot remove, refusing sockets,
  ``ctypes`` (a way around the hook), starting other programs (they would run without it) and
  writes outside its directory.

What breaks a limit comes back as an error observation, never as an exception in the caller.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PIDS_CGROUPS = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))  # cgroup v1, then v2
# What the program's first lines do before its own.
PRELUDE = """\
import os as _os, sys as _sys
_root = _os.path.realpath(".")
_NET = ("socket.connect", "socket.bind", "socket.sendto", "socket.getaddrinfo", "socket.__new__")
_RUN = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen")
def _guard(event, args):
    if event in _NET:
        raise PermissionError("the sandbox has no network")
    if event in ("ctypes.dlopen", "ctypes.dlsym", "ctypes.dlsym/handle"):
        raise PermissionError("the sandbox has no ctypes")
    if event in _RUN:
        raise PermissionError("the sandbox runs no other programs")
    if event == "open" and len(args) > 1 and isinstance(args[1], str) and any(
        m in args[1] for m in "wax+"
    ):
        name = args[0]
        path = _os.path.realpath(_os.fsdecode(name)) if isinstance(name, (str, bytes)) else _root
        if path != _root and not path.startswith(_root + _os.sep):
            raise PermissionError(f"the sandbox writes only inside its directory: {args[0]!r}")
_sys.addaudithook(_guard)
del _guard
"""


class SandboxLimits(BaseModel):
    """What a program run by the code tool may use."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    wall_seconds: float = Field(10.0, gt=0)
    """Wall-clock seconds before the whole process group is killed."""
    cpu_seconds: int = Field(5, gt=0)
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = Field(512, gt=0)
    """Address space in MiB (RLIMIT_AS)."""
    processes: int = Field(8, gt=0)
    """Processes and threads it may start beside what this user already runs (RLIMIT_NPROC)."""
    file_mb: int = Field(16, gt=0)
    """Largest file it may write, in MiB (RLIMIT_FSIZE)."""
    output_chars: int = Field(4096, gt=0)
    """Characters of stdout and of stderr kept (the rest cut, and said so)."""


@dataclass(frozen=True)
class RunResult:
    """What a program did: its output, exit code (negative: killed by that signal) and why it
    stopped if a limit stopped it."""

    stdout: str
    stderr: str
    exit_code: int
    limit: str | None  # "wall", "cpu", "memory", ... when a limit ended it
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None


def _tasks_of(uid: int) -> int:
    """Processes and threads ``uid`` runs now (what RLIMIT_NPROC counts)."""
    n = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, StopIteration, ValueError):
            lines = status.read_text().splitlines()
            if int(next(x for x in lines if x.startswith("Uid:")).split()[1]) == uid:
                n += int(next(x for x in lines if x.startswith("Threads:")).split()[1])
    return n


def _pids_cgroup(name: str, processes: int) -> Path | None:
    """A pids cgroup capped at ``processes`` (the program's own process included), if this
    process may make one."""
    for root in PIDS_CGROUPS:
        if not (root / "cgroup.procs").exists() or not os.access(root, os.W_OK):
            continue
        path = root / name
        try:
            path.mkdir()
            (path / "pids.max").write_text(str(processes + 1))
            return path
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
    return None


def _limit_child(limits: SandboxLimits, cgroup: Path | None, nproc: int) -> None:
    """In the child, before exec: its own process group and cgroup, the rlimits, and its own
    user and network namespaces where the kernel allows them."""
    os.setsid()
    if cgroup is not None:
        (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    else:
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    mib = 2**20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mib,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET)  # 0, or -1: the hook


def _end(pgid: int, cgroup: Path | None) -> None:
    """Kill the program's process group and everything in its cgroup, then drop the cgroup."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    if cgroup is None:
        return
    for _ in range(100):
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    with contextlib.suppress(OSError):
        cgroup.rmdir()


def _cut(text: bytes, n: int) -> str:
    s = text.decode(errors="replace")
    return s if len(s) <= n else s[:n] + f"\n[... {len(s) - n} more characters cut]"


# What a limit leaves in stderr when it stops the program by an exception, not a signal.
STDERR_SIGNS = (
    ("MemoryError", "memory"),
    ("File too large", "file size"),  # Python ignores SIGXFSZ: the write fails with EFBIG
    ("Resource temporarily unavailable", "processes"),
    ("the sandbox has no network", "network"),
    ("the sandbox writes only inside its directory", "write outside"),
    ("the sandbox has no ctypes", "ctypes"),
    ("the sandbox runs no other programs", "programs"),
)


def _which_limit(code: int, timed_out: bool, stderr: str) -> str | None:
    """Which limit ended the run, if one did."""
    if timed_out:
        return "wall"
    if code in (-signal.SIGXCPU, -signal.SIGKILL):  # the soft CPU limit, then the hard one
        return "cpu"
    if code == 0:
        return None
    return next((name for sign, name in STDERR_SIGNS if sign in stderr), None)


def run_python(code: str, limits: SandboxLimits | None = None) -> RunResult:
    """Run ``code`` with ``python -I -S`` in a fresh directory under ``limits``."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rayhf-sandbox-") as tmp:
        cgroup = _pids_cgroup(Path(tmp).name, limits.processes)
        nproc = 0 if cgroup else _tasks_of(os.getuid()) + limits.processes
        Path(tmp, "main.py").write_text(PRELUDE + code)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "main.py"],
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                preexec_fn=lambda: _limit_child(limits, cgroup, nproc),
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                timed_out = True
            _end(proc.pid, cgroup)  # the program if it still runs, and whatever it started
            proc.wait()
            stdout, stderr = (_read(f, limits.output_chars) for f in (out, err))
    return RunResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=proc.returncode,
        limit=_which_limit(proc.returncode, timed_out, stderr),
        seconds=time.monotonic() - start,
    )


def _read(f: Any, n: int) -> str:
    f.seek(0)
    return _cut(f.read(), n)
