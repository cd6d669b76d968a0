"""`rayhf serve` as its process: SIGINT (Ctrl-C) or SIGTERM (a pod being stopped) ends it within
5 seconds, leaving no Ray process behind."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import requests
from test_cli_processes import _cmdline, _descendants, _stat
from test_serve import free_port, make_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.alone]  # within 5 s: not beside another test's load


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_stops_within_5_s_on_a_signal_and_leaves_no_process(tmp_path, sig):
    ckpt = make_checkpoint(tmp_path / "policy")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rayhf", "serve", str(ckpt), "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    seen: dict[int, int] = {}
    end = time.monotonic() + 180
    while time.monotonic() < end and proc.poll() is None:
        seen.update(_descendants(proc.pid))
        try:
            if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).ok:
                break
        except requests.RequestException:
            time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    seen.update(_descendants(proc.pid))
    assert len(seen) > 3, f"recorded only {seen}"  # the CLI, Ray's services, the replica
    proc.send_signal(sig)  # to the process alone, as kill(1) or a kubelet sends it
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    took = time.monotonic() - sent
    print(f"{sig.name}: stopped in {took:.1f} s")
    assert took < 5, f"took {took:.1f} s to stop: {out[-2000:]}"
    time.sleep(2)  # a process exits a moment after its parent
    alive = [p for p, start in seen.items() if (_stat(p) or (0, -1))[1] == start]
    assert not alive, [f"{p}: {_cmdline(p)[:80]}" for p in alive]
