"""rayhf on a Ray cluster of several nodes on this machine, each with its own emulated device:
a run whose placement group spans both nodes recovers when one node is removed and a
replacement joins; the RayJob entrypoint that ``rayhf k8s render`` writes runs through
``ray job submit`` against a ``ray start`` cluster (what a KubeRay RayJob does).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO
from ray.cluster_utils import Cluster
from test_cli_processes import EXAMPLE, Run, _args, _cmdline, _descendants

from rayhf.k8s.render import render

pytestmark = pytest.mark.ray
DEVICE = {"rayhf_device": 1.0}  # one emulated device per node: a 2-device run spans both


def _overrides(tmp: Path, **extra: object) -> list[str]:
    """The tiny run's overrides (``test_cli_processes._args`` without the config), on 2 devices."""
    return _args(tmp, **{"cluster.n_devices": 2, **extra})[1:]


def _workers_under(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if "RoleWorker" in _cmdline(p)]


@pytest.fixture
def two_nodes():
    cluster = Cluster(
        initialize_head=True, connect=False,
        head_node_args={"num_cpus": 1, "resources": DEVICE, "include_dashboard": False},
    )  # fmt: skip
    worker = cluster.add_node(num_cpus=1, resources=DEVICE)
    cluster.wait_for_nodes()
    yield cluster, worker
    cluster.shutdown()


def test_a_run_across_two_nodes_recovers_when_one_is_replaced(tmp_path, two_nodes):
    cluster, worker = two_nodes
    args = _overrides(tmp_path, steps=10, save_every=1, **{"cluster.address": cluster.address})
    run = Run(tmp_path, str(EXAMPLE), *args)
    raylet = worker.all_processes["raylet"][0].process.pid
    run.watch_until(lambda: run.steps_logged() >= 3 and bool(_workers_under(raylet)))
    assert _workers_under(raylet), "no role-group worker ran on the second node"
    cluster.remove_node(worker)  # the node is lost with the actors on it
    time.sleep(2)
    cluster.add_node(num_cpus=1, resources=DEVICE)  # KubeRay would start a new pod
    run.watch_until(lambda: False, timeout=300)
    code, err = run.finish()
    recoveries = [line for line in err.splitlines() if line.startswith("rayhf: recovering")]
    assert code == 0 and len(recoveries) == 1, err
    steps = [json.loads(line)["step"] for line in (run.run_dir / "metrics.jsonl").open()]
    assert steps == list(range(1, 11))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_dashboard(port: int, timeout: float = 90) -> None:
    """Until the job server answers (``ray start`` returns before it does)."""
    end = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/version", timeout=2).close()
            return
        except urllib.error.HTTPError:  # it answers (token authentication: 401 without one)
            return
        except OSError:
            assert time.monotonic() < end, "the Ray dashboard never came up"
            time.sleep(1)


def test_the_rendered_rayjob_entrypoint_runs_through_ray_job_submit(tmp_path):
    job = next(d for d in render(EXAMPLE, "1x2xH100") if d["kind"] == "RayJob")
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:2] == ["rayhf", "run"] and "cluster.address=auto" in words
    words[2] = str(EXAMPLE)  # the ConfigMap's mount point is the example itself
    words += ["cluster.device=cpu", *_overrides(tmp_path, steps=2)]  # later overrides win
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["RAY_AUTH_MODE"] = "disabled"  # a local test cluster: no token to hand the job client
    # its own temp dir: the `ray start` cluster must not become the one a later ray.init() finds
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: socket paths
    port, dashboard = _free_port(), _free_port()
    # every port its own: the suite's cluster already holds the defaults (the dashboard agent's
    # 52365 above all: without it the job server has "No available agent")
    ports = [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
        "ray-client-server-port", "runtime-env-agent-port",
    )]  # fmt: skip
    head = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         f"--resources={json.dumps({'rayhf_device': 2})}", "--include-dashboard=true",
         f"--dashboard-port={dashboard}", "--disable-usage-stats", *ports],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for_dashboard(dashboard)
        for _ in range(15):  # the head's job agent starts after the dashboard answers
            submitted = subprocess.run(
                ["ray", "job", "submit", f"--address=http://127.0.0.1:{dashboard}",
                 f"--working-dir={tmp_path}", "--", *words],
                env=env, cwd=REPO, capture_output=True, text=True, timeout=400,
            )  # fmt: skip
            if "No available agent" not in submitted.stderr + submitted.stdout:
                break
            time.sleep(2)
        assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-2000:]
        assert "succeeded" in submitted.stdout, submitted.stdout[-3000:]
    finally:
        # `ray start` stops its services in turn on SIGTERM, in 3 s; signalled all at once (its
        # process group), they took 34 s. What outlives it is killed.
        head.terminate()
        head.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert steps == [1, 2]
