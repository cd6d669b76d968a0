"""The driver: runs one iteration of the graph over the role groups.

    dataset rows -> step batch --(keys a call reads)--> [call on its role group, dp-split]
                 <--(keys it writes)-- joined in sample order ... every call in graph order

The step batch lives in the driver; each call gets the keys it reads (renamed to its
interface's names), split across its role group's data-parallel replicas, and its outputs are
merged back under the graph's key names. A call whose layout is not its role's home layout runs
on a copy: the weights are reallocated home -> copy before the call and the copy is dropped
after it. After a role trains, roles that follow it by EMA are blended toward it. Every call
and move is kept as a ``Span`` (wall-clock start and end, role, layout) for the run's trace.
``Executor`` is the seam behind which a compiled-graph executor can replace ``PlainExecutor``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from rayhf.data.batch import PackedBatch
from rayhf.graph import Call, Graph
from rayhf.metrics.trace import Span
from rayhf.models.spec import ModelSpec
from rayhf.realloc.collective import ReallocStats, WeightMover
from rayhf.runtime.role_group import RoleGroup


@dataclass
class StepOutcome:
    batch: PackedBatch
    stats: dict[str, float] = field(default_factory=dict)
    compute_seconds: dict[str, float] = field(default_factory=dict)  # slowest rank, per call
    wall_seconds: dict[str, float] = field(default_factory=dict)  # as seen by the driver
    reallocs: dict[str, ReallocStats] = field(default_factory=dict)  # by what they served
    spans: list[Span] = field(default_factory=list)  # every call and move, for the trace


class Executor(Protocol):
    def run_step(self, step: int, batch: PackedBatch, evaluate: bool = False) -> StepOutcome:
        """One iteration; with ``evaluate`` train calls report metrics instead of updating."""
        ...


@dataclass
class Placement:
    """Where calls run and how weights reach them (the session provides it)."""

    group_of_call: Callable[[str], RoleGroup]
    homes: dict[str, RoleGroup]  # role -> the group holding its weights
    specs: dict[str, ModelSpec]  # role -> model shape (reallocation plans)
    mover: WeightMover
    followers: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # EMA targets


def call_inputs(batch: PackedBatch, call: Call) -> PackedBatch:
    """The keys ``call`` reads, under its interface's names."""
    view = PackedBatch(list(batch.sample_ids))
    for iface_key, graph_key in call.interface_inputs().items():
        if graph_key not in batch.tensors:
            raise RuntimeError(
                f"call '{call.name}' reads '{graph_key}', which is not in the batch: keys made "
                f"before a call that created new samples do not carry over"
            )
        view.add(iface_key, batch.tensors[graph_key], batch.seqlens[graph_key])
    return view


def merge_outputs(batch: PackedBatch, out: PackedBatch, call: Call) -> None:
    """Add ``call``'s outputs to the step batch under the graph's key names."""
    for iface_key, graph_key in call.interface_outputs().items():
        if iface_key not in out.tensors:
            raise RuntimeError(f"call '{call.name}' did not produce '{iface_key}'")
        batch.add(graph_key, out.tensors[iface_key], out.seqlens[iface_key])


class PlainExecutor:
    """Calls in topological order with plain ``.remote()`` actor calls."""

    def __init__(self, graph: Graph, placement: Placement) -> None:
        self.graph, self.placement = graph, placement

    def run_step(self, step: int, batch: PackedBatch, evaluate: bool = False) -> StepOutcome:
        outcome = StepOutcome(batch)
        for name in self.graph.order:
            call = self.graph.by_name[name]
            start = time.perf_counter()
            group = self.placement.group_of_call(name)
            home = self.placement.homes[call.role]
            if group is not home:
                outcome.reallocs[name] = self._move(
                    home, group, call.role, f"realloc:{name}", outcome
                )
            began = time.time()
            result = group.run(name, call.kind, step, call_inputs(batch, call), evaluate)
            outcome.spans.append(
                Span(name, "call", call.role, group.layout.name, group.key, began, time.time())
            )
            if group is not home:
                group.release()
            if result.batch is not None:
                if result.batch.sample_ids != batch.sample_ids:
                    # a generate call made several samples per input: they form the batch now
                    batch = outcome.batch = PackedBatch(result.batch.sample_ids)
                merge_outputs(batch, result.batch, call)
            outcome.stats.update(result.stats)
            outcome.compute_seconds[name] = result.compute_seconds
            outcome.wall_seconds[name] = time.perf_counter() - start
            if call.kind == "train" and not evaluate:
                for follower, eta in self.placement.followers.get(call.role, []):
                    dst = self.placement.homes[follower]
                    outcome.reallocs[f"{follower}_ema"] = self._move(
                        home, dst, follower, f"ema:{follower}", outcome, eta
                    )
        return outcome

    def _move(
        self, src: RoleGroup, dst: RoleGroup, role: str, what: str, outcome: StepOutcome,
        eta: float | None = None,
    ) -> ReallocStats:  # fmt: skip
        """Move ``role``'s weights ``src`` -> ``dst`` (blend them in by ``eta``), traced as
        ``what`` on the destination's track."""
        began = time.time()
        moved = self.placement.mover.move(src, dst, self.placement.specs[role], eta)
        layouts = f"{src.layout.name} -> {dst.layout.name}"
        outcome.spans.append(
            Span(
                what, "realloc", role, layouts, dst.key, began, time.time(), {"bytes": moved.bytes}
            )
        )
        return moved
