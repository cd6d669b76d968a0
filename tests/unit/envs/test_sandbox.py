"""The code runner's limits: each hostile program comes back as an error observation within its
limit, nothing it started is left running, and a well-behaved program's output comes back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rayhf.envs.sandbox import SandboxLimits, run_python

FAST = SandboxLimits(wall_seconds=4, cpu_seconds=1, memory_mb=256, processes=16, file_mb=1)


def test_a_program_s_output_and_exit_code_come_back():
    r = run_python("import sys\nprint(sum(range(10)))\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert (r.stdout, r.stderr.strip(), r.exit_code, r.limit) == ("45\n", "oops", 3, None)
    ok = run_python("open('notes.txt', 'w').write('x'); print(open('notes.txt').read())")
    assert ok.ok and ok.stdout == "x\n", ok.stderr  # its own directory is writable


@pytest.mark.parametrize(
    ("name", "code", "limit"),
    [
        ("infinite loop", "while True:\n    pass", "cpu"),
        ("sleeping forever", "import time\ntime.sleep(60)", "wall"),
        ("memory bomb", "x = []\nwhile True:\n    x.append(bytearray(2**24))", "memory"),
        ("huge file", "open('big', 'wb').write(b'0' * 2**22)", "file size"),
        (
            "network",
            "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)",
            "network",
        ),
        ("write outside", "open('/tmp/rayhf-sandbox-escape', 'w').write('x')", "write outside"),
        ("ctypes", "import ctypes\nctypes.CDLL(None).system(b'true')", "ctypes"),
        ("another program", "import subprocess\nsubprocess.run(['/bin/true'])", "programs"),
    ],
)
def test_each_hostile_program_is_stopped_by_its_limit(name, code, limit):
    r = run_python(code, FAST)
    assert not r.ok and r.limit == limit, (name, r)
    assert r.seconds < FAST.wall_seconds + 3, name
    assert not Path("/tmp/rayhf-sandbox-escape").exists()


def test_a_fork_bomb_is_capped_and_nothing_it_started_survives():
    code = """
import os, time
kids = []
try:
    for _ in range(1000):
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
        kids.append(pid)
except OSError:
    print(*kids)
    raise
"""
    r = run_python(code, FAST)
    assert r.limit == "processes", r
    kids = [int(k) for k in r.stdout.split()]
    assert 0 < len(kids) <= FAST.processes
    assert all(_gone(k) for k in kids), "children of the run are still alive"


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (a zombie waiting for its reaper counts as ended)."""
    for _ in range(200):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.01)
    return False


def test_a_program_that_leaves_a_child_running_has_it_killed():
    code = "import os, time\npid = os.fork()\nif pid == 0:\n    time.sleep(600)\nprint(pid)"
    r = run_python(code, FAST)
    assert r.ok, r
    assert _gone(int(r.stdout)), "the sleeping child outlived the run"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)
