"""Probe role groups (``rayhf.runtime.probe``): the real driver's DAG over actors whose calls do
nothing. Ray's actor creation is replaced by plain objects, and the DAG is run by hand in graph
order, as the executors would run it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import rayhf.runtime.probe as probe
from rayhf.runtime.messages import CallNode, StepInput
from rayhf.runtime.probe import ProbeWorker, probe_batch, probe_executor


@pytest.fixture
def killed(monkeypatch) -> list[Any]:
    """``ray.remote(...)(ProbeWorker).remote(s)`` makes a plain ``ProbeWorker(s)``."""
    out: list[Any] = []

    def remote(**options: Any):
        assert options == {"num_cpus": 0.25}
        return lambda cls: SimpleNamespace(remote=cls)

    monkeypatch.setattr(
        probe, "ray", SimpleNamespace(remote=remote, kill=lambda a, **kw: out.append(a))
    )
    return out


def _run(dag, batch):
    results: list[Any] = []
    for node in dag.nodes:
        method = getattr(node.info.actor, node.method)
        results.append(method(StepInput(1, batch), node.const, *(results[i] for i in node.args)))
    return dag.outcome(1, batch, results)


def test_a_chain_of_probe_calls_reads_each_previous_call(killed):
    executor, groups = probe_executor([(0,), (1, 2)], chain=True, seconds=0.0, compiled=False)
    dag = executor.dag(False)
    assert [g.key for g in groups] == ["r0.d0.dp1tp1pp1", "r1.d1-2.dp2tp1pp1"]
    assert [(n.info.unit.name, n.info.rank) for n in dag.nodes] == [
        ("r0_inf", 0), ("r1_inf", 0), ("r1_inf", 1),
    ]  # fmt: skip
    assert [n.args for n in dag.nodes] == [(), (0,), (0,)], "r1 reads r0's head"
    out = _run(dag, probe_batch(4, 2))
    assert set(out.compute_seconds) == {"r0_inf", "r1_inf"}
    assert {s.args["engine"] for s in out.spans} == {"probe"}
    for g in groups:
        g.kill()
    assert len(killed) == 3


def test_independent_probe_calls_on_disjoint_meshes_wait_for_nothing(killed):
    executor, _ = probe_executor([(0,), (1,)], chain=False, seconds=0.0, compiled=True)
    assert executor.compiled
    assert [n.args for n in executor.dag(False).nodes] == [(), ()]


def test_a_probe_worker_sleeps_as_told_and_the_batch_is_rows_of_zeros():
    result = ProbeWorker(0.01).dag_call(StepInput(0, probe_batch()), CallNode("r0_inf", ()))
    assert result.call == "r0_inf" and result.engine == "probe" and result.batch is None
    assert result.seconds >= 0.01 and result.ended - result.began >= 0.01
    batch = probe_batch(3, 2)
    assert batch.sample_ids == [0, 1, 2] and batch.seqlens == {"rows": [2, 2, 2]}
    assert batch.tensors["rows"].tolist() == [0] * 6
