"""Single-call graphs as Ray Train jobs (``rayhf.runtime.train_stage``): the parts that run on
the driver before and after ``TorchTrainer.fit``, with fakes for Ray's cluster and queue."""

from __future__ import annotations

import threading
from pathlib import Path
from queue import Empty, Queue
from types import SimpleNamespace

import pytest

import rayhf
import rayhf.runtime.train_stage as train_stage
from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.runtime.train_stage import (
    QueueCallback,
    _copy_role,
    _drain,
    _scaling,
    _stage_call,
    absolute_paths,
)

REPO = Path(__file__).resolve().parents[3]


def test_workers_get_absolute_paths(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg = rayhf.load_config(REPO / "examples" / "sft_tiny.yaml")
    assert not Path(cfg.dataset.path).is_absolute()
    fixed = absolute_paths(cfg)
    assert fixed.dataset.path == str(tmp_path / cfg.dataset.path)
    assert Path(fixed.graph).is_absolute() and Path(fixed.graph).name == "sft.yaml"
    assert fixed.dataset.eval_path == str(tmp_path / str(cfg.dataset.eval_path))
    assert fixed.models == cfg.models, "nothing else changes"


def test_a_stage_runs_a_graph_of_exactly_one_train_call():
    sft = SimpleNamespace(graph=load_graph(REPO / "graphs" / "sft.yaml"))
    (call,) = sft.graph.calls
    assert _stage_call(sft) == (call.role, call.interface)  # type: ignore[arg-type]
    ppo = SimpleNamespace(graph=load_graph(REPO / "graphs" / "ppo.yaml"))
    with pytest.raises(RayhfError, match=r"graph 'ppo' has 6 calls; .* `rayhf run`"):
        _stage_call(ppo)  # type: ignore[arg-type]


def test_one_worker_per_device_with_its_share_of_the_cpus(monkeypatch):
    monkeypatch.setattr(train_stage, "ray", SimpleNamespace(cluster_resources=lambda: {"CPU": 6}))
    cfg = rayhf.load_config(REPO / "examples" / "sft_tiny.yaml", ["cluster.n_devices=4"])
    cpu = _scaling(cfg)
    assert (cpu.num_workers, cpu.use_gpu) == (4, False)
    assert cpu.resources_per_worker == {"CPU": 1.5, "rayhf_device": 1.0}
    gpu = _scaling(cfg.with_overrides({"cluster.device": "cuda", "cluster.n_devices": 48}))
    assert gpu.use_gpu and gpu.resources_per_worker == {"CPU": 0.25}, "at least a quarter CPU"


def test_rank_0_s_reports_reach_the_tracker_in_order():
    queue: Queue = Queue()
    callback = QueueCallback(queue)  # type: ignore[arg-type]
    metrics = [{"step": 1, "loss": 2.0}, {"step": 1, "loss": 9.0}]  # one dict per rank
    callback.after_report(None, metrics, None)
    callback.after_report(None, [{"step": 2, "loss": 1.0}], None)
    metrics[0]["loss"] = -1.0  # the queue holds a copy
    logged: list = []
    done = threading.Event()
    done.set()  # the run is over: drain what is left, then stop
    fake_queue = SimpleNamespace(get=lambda timeout: queue.get_nowait(), empty=queue.empty)
    _drain(fake_queue, SimpleNamespace(log=lambda step, row: logged.append((step, row))), done)  # type: ignore[arg-type]
    assert logged == [(1, {"loss": 2.0}), (2, {"loss": 1.0})]
    with pytest.raises(Empty):
        queue.get_nowait()


def test_the_last_checkpoint_s_role_is_copied_whole(tmp_path):
    (tmp_path / "src" / "actor" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "actor" / "sub" / "w.bin").write_bytes(b"123")
    (tmp_path / "src" / "other").mkdir()
    (tmp_path / "dst").mkdir()
    _copy_role(tmp_path / "src", tmp_path / "dst", "actor")
    assert (tmp_path / "dst" / "actor" / "sub" / "w.bin").read_bytes() == b"123"
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["actor"]
