"""Probe role groups: the real driver over actors whose calls do nothing (or sleep), to measure
the driver itself (benchmarks/driver_overhead.py) and test its concurrency without models.

    probe_executor(meshes) -> a graph of one inference call per role ``r{i}``, each role a group
    of ``ProbeWorker`` actors on its own mesh -> ``DagExecutor`` (plain or compiled)
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
import torch

from rayhf.data.batch import PackedBatch
from rayhf.graph import Call, Graph
from rayhf.parallel.layout import Layout
from rayhf.planner.step import group_key
from rayhf.runtime.driver import DagExecutor, Placement
from rayhf.runtime.messages import CallNode, CallResult, StepInput


class ProbeWorker:
    """A role-group rank whose calls return at once, or after sleeping ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def pid(self) -> int:
        return os.getpid()

    def dag_call(self, step: StepInput, node: CallNode, *upstream: Any) -> CallResult:
        began = time.time()
        if self.seconds:
            time.sleep(self.seconds)
        return CallResult(node.call, 0, None, {}, time.time() - began, "probe", began, time.time())


class ProbeGroup:
    """What the driver reads of a role group, over ``ProbeWorker`` actors (a quarter CPU each)."""

    def __init__(self, role: str, layout: Layout, seconds: float) -> None:
        self.role, self.layout, self.key = role, layout, group_key(role, layout)
        remote = ray.remote(num_cpus=0.25)(ProbeWorker)
        self.actors: list[Any] = [remote.remote(seconds) for _ in layout.mesh]

    @property
    def ranks_per_replica(self) -> int:
        return self.layout.tp * self.layout.pp

    def actor_name(self, rank: int) -> str:
        return f"{self.key}[{rank}]"

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)


def probe_executor(
    meshes: list[tuple[int, ...]], chain: bool, seconds: float, compiled: bool
) -> tuple[DagExecutor, list[ProbeGroup]]:
    """One inference call ``r{i}_inf`` per mesh, on role ``r{i}`` (all ranks data-parallel);
    with ``chain`` each call reads the previous call's output, else all read the step input."""
    calls = [
        Call(
            name=f"r{i}_inf",
            role=f"r{i}",
            kind="inference",
            interface="probe",
            inputs=[f"k{i - 1}" if chain and i else "rows"],
            outputs=[f"k{i}"],
        )
        for i in range(len(meshes))
    ]
    graph = Graph(name="probe", inputs=["rows"], calls=calls)
    layouts = {f"r{i}_inf": Layout(mesh, len(mesh)) for i, mesh in enumerate(meshes)}
    groups = [ProbeGroup(f"r{i}", layouts[f"r{i}_inf"], seconds) for i in range(len(meshes))]
    homes = {g.role: g.layout for g in groups}
    by_key: dict[str, Any] = {g.key: g for g in groups}
    placement = Placement(by_key, layouts, homes, {}, None)  # type: ignore[arg-type]
    return DagExecutor(graph, placement, compiled, timeout_s=600), groups


def probe_batch(n_samples: int = 8, tokens: int = 8) -> PackedBatch:
    rows = torch.zeros(n_samples * tokens, dtype=torch.long)
    return PackedBatch(list(range(n_samples)), {"rows": rows}, {"rows": [tokens] * n_samples})
