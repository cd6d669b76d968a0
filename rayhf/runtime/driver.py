"""The driver: each step of the graph as one Ray DAG over the role groups' actors.

    step input (dataset rows) --InputNode--> every node
    units (planner.step.plan_step) -> per unit, one node per taking-part actor:
        call:   actor.dag_call(input, CallNode, *source heads' results, *ordering nodes)
        move:   sender.dag_send(...) / receiver.dag_recv(...)   (in the same wave)
    MultiOutputNode(all nodes) -> StepOutcome (batch, stats, timings, spans)

Data moves actor to actor: a call's node receives its source calls' head results and assembles
its own replica's share (``flow``); the driver only gets every node's result to report. Each
node also takes the previous node on its actor and, per unit it must follow, that unit's node on
the same device, so both executors keep the schedule's order; a call on a copy also takes its
move's first sender, whose result names the version of the weights it sent. ``DagExecutor``
runs the same DAG with plain ``.remote()`` actor calls or compiled (``experimental_compile``);
see docs/decisions/ for which one is the default where.

Steps overlap (plain calls, ``driver.overlap_steps``): step i+1 is submitted while step i runs,
each of its nodes also taking the nodes of step i that ``planner.step.carried`` names (its
devices' last units and its role's last update), so the actors run it as soon as the dataflow
allows and every result is what one step at a time gives. With ``max_staleness: k`` a step is
submitted in two parts (``planner.step.pipeline``): its leading part (the policy's generation,
with the frozen models' calls beside it: ``planner.step.leading``) k periods before the rest,
and each node takes the nodes of other steps the pipeline names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import ray
from ray.dag import InputNode, MultiOutputNode

from rayhf.data.batch import PackedBatch
from rayhf.errors import RunFailed
from rayhf.graph import Graph
from rayhf.metrics.trace import TraceSpan
from rayhf.models.spec import ModelSpec
from rayhf.parallel.layout import Layout
from rayhf.planner.step import StepOptions, Unit, leading, pipeline, plan_step
from rayhf.realloc.mover import ReallocStats, TransferGroupMover
from rayhf.runtime.flow import assemble
from rayhf.runtime.messages import CallNode, CallResult, MoveNode, MoveResult, StepInput
from rayhf.runtime.role_group import RoleGroup
from rayhf.runtime.waits import Pending, died, gather, pending, raise_user_error


@dataclass
class StepOutcome:
    batch: PackedBatch
    stats: dict[str, float] = field(default_factory=dict)
    compute_seconds: dict[str, float] = field(default_factory=dict)  # slowest rank, per call
    peak_bytes: dict[str, int] = field(default_factory=dict)  # fullest device, per call
    wall_seconds: dict[str, float] = field(default_factory=dict)  # first start to last end
    reallocs: dict[str, ReallocStats] = field(default_factory=dict)  # by what they served
    spans: list[TraceSpan] = field(default_factory=list)  # every call and move, for the trace


@dataclass
class Placement:
    """Where calls run and how weights reach them (the session provides it)."""

    groups: dict[str, RoleGroup]  # group key -> group
    layouts: dict[str, Layout]  # call -> its layout
    homes: dict[str, Layout]  # role -> the layout holding its weights
    specs: dict[str, ModelSpec]  # role -> model shape (reallocation plans)
    mover: TransferGroupMover
    step: StepOptions = field(default_factory=StepOptions)  # EMA blends, LoRA roles' copies


@dataclass(frozen=True)
class NodeInfo:
    """Which unit and which actor a DAG node is."""

    unit: Unit
    group: RoleGroup
    rank: int

    @property
    def actor_name(self) -> str:
        return self.group.actor_name(self.rank)

    @property
    def actor(self) -> Any:  # ActorHandle[RoleWorker]
        return self.group.actors[self.rank]

    @property
    def device(self) -> int:
        return self.group.layout.mesh[self.rank]

    @property
    def is_head(self) -> bool:
        """The rank that reports its replica's results (``ParallelGroups.is_head``)."""
        return self.rank % (self.group.ranks_per_replica * self.group.layout.cp) == 0

    @property
    def doing(self) -> str:
        """What this node does, for a failure's message."""
        kind = "call" if self.unit.kind == "call" else "weight move"
        return f"{kind} '{self.unit.name}'"


@dataclass(frozen=True)
class Node:
    """One actor method call of a step: ``method(step input, const, *results of args)``."""

    info: NodeInfo
    method: str  # dag_call | dag_send | dag_recv
    const: CallNode | MoveNode
    args: tuple[int, ...]  # indices of earlier nodes whose results it takes
    # (steps later, index) of other steps' nodes it runs after (the previous step's, or with
    # max_staleness the steps a period holds) and of its own step's it is ordered after
    cross: tuple[tuple[int, int], ...] = ()


class StepDag:
    """The units of one step (train or evaluate) as actor calls with their arguments; bound as
    a Ray DAG (``ray_dag``) for the compiled executor."""

    def __init__(
        self, graph: Graph, placement: Placement, evaluate: bool, staleness: int = 0
    ) -> None:
        self.graph, self.placement, self.evaluate = graph, placement, evaluate
        self.staleness = staleness
        self.units = plan_step(graph, placement.layouts, placement.homes, placement.step, evaluate)
        lead = leading(graph, self.units, 0 if evaluate else staleness)
        self.nodes: list[Node] = []
        of_unit: dict[str, list[int]] = {}
        last_on_actor: dict[str, int] = {}
        for unit in self.units:
            of_unit[unit.name] = []
            for info, method, const in self._parts(unit):
                heads = [i for s in unit.sources for i in of_unit[s] if self.nodes[i].info.is_head]
                order = [self._on_device(of_unit[a], info.device) for a in sorted(unit.after)]
                sent = self._sender(of_unit.get(f"realloc:{unit.name}", []))
                before = last_on_actor.get(info.actor_name)
                extra = [j for j in (sent, before) if j is not None]
                args = dict.fromkeys([*heads, *order, *extra])
                of_unit[unit.name].append(len(self.nodes))
                last_on_actor[info.actor_name] = len(self.nodes)
                self.nodes.append(Node(info, method, const, tuple(args)))
        slots = {s.unit.name: s for s in pipeline(self.units, lead, staleness)}
        for i, node in enumerate(self.nodes):
            slot = slots[node.info.unit.name]
            cross = {
                (slot.offset(lag, slots[a]), self._on_device(of_unit[a], node.info.device))
                for lag, a in slot.after
            }
            cross -= {(0, j) for j in (*node.args, i)}
            self.nodes[i] = replace(node, cross=tuple(sorted(cross)))
        self.leading = [i for i, n in enumerate(self.nodes) if n.info.unit.name in lead]

    def _on_device(self, nodes: list[int], device: int) -> int:
        """The node among ``nodes`` (one unit's) on ``device`` that ends last, else the unit's
        last: a move's receivers come after its senders and finish after them."""
        return next((i for i in reversed(nodes) if self.nodes[i].info.device == device), nodes[-1])

    def _sender(self, nodes: list[int]) -> int | None:
        """The first sending node among a move's ``nodes``: a call on the copy takes its result
        for the version of the weights it holds."""
        return next((i for i in nodes if self.nodes[i].method == "dag_send"), None)

    def ray_dag(self) -> Any:
        """The same calls bound as a Ray DAG: ``InputNode`` -> nodes -> ``MultiOutputNode``."""
        bound: list[Any] = []
        with InputNode() as step_input:
            for node in self.nodes:
                method = getattr(node.info.actor, node.method)
                bound.append(method.bind(step_input, node.const, *(bound[i] for i in node.args)))
            return MultiOutputNode(bound)

    def submit(
        self,
        step_input: StepInput,
        refs: list[Any],
        which: list[int],
        other: Callable[[int], list[Any] | None] = lambda step: None,
    ) -> None:
        """The nodes ``which`` (in order) as plain ``.remote()`` calls, results passed as object
        refs, each into ``refs`` (this step's, one per node; None: not submitted yet). ``other``
        gives another step's refs while it is in flight (None once collected): each node also
        waits for the nodes of other steps it runs after."""
        input_ref = ray.put(step_input)
        for i in which:
            node = self.nodes[i]
            method = getattr(node.info.actor, node.method)
            prior = []
            for later, j in node.cross:
                assert later != 0 or j < i, "a node runs after an earlier node of its step"
                theirs = refs if later == 0 else other(step_input.step + later)
                if theirs is not None and theirs[j] is not None:
                    prior.append(theirs[j])
            refs[i] = method.remote(input_ref, node.const, *(refs[j] for j in node.args), *prior)

    def _parts(self, unit: Unit) -> Iterator[tuple[NodeInfo, str, CallNode | MoveNode]]:
        """(node info, method name, its constant argument) for every actor of ``unit``."""
        groups = [self.placement.groups[k] for k in unit.groups]
        if unit.kind == "call":
            (group,) = groups
            const = CallNode(unit.name, unit.sources, self.evaluate, unit.release)
            for rank in range(len(group.actors)):
                yield NodeInfo(unit, group, rank), "dag_call", const
            return
        src, dst = groups
        spec = self.placement.specs[unit.role]
        routes = self.placement.mover.routes(src, dst, spec, unit.skip_frozen)
        for rank, by_peer in routes.sends.items():
            move = MoveNode(unit.name, routes.group, by_peer, dtype=routes.dtype)
            yield NodeInfo(unit, src, rank), "dag_send", move
        for rank, by_peer in routes.recvs.items():
            forward = routes.forwards.get(rank, {})
            move = MoveNode(unit.name, routes.group, by_peer, unit.eta, forward=forward)
            yield NodeInfo(unit, dst, rank), "dag_recv", move

    def outcome(self, step: int, base: PackedBatch, results: list[Any]) -> StepOutcome:
        """The step's batch, stats, timings and spans from every node's result."""
        by_unit: dict[str, list[tuple[NodeInfo, Any]]] = {u.name: [] for u in self.units}
        for node, result in zip(self.nodes, results, strict=True):
            by_unit[node.info.unit.name].append((node.info, result))
        calls = [u for u in self.units if u.kind == "call"]
        heads = [
            (u.name, [r.batch for i, r in by_unit[u.name] if i.is_head and r.batch is not None])
            for u in calls
        ]
        out = StepOutcome(assemble(base, heads))
        for unit in self.units:
            parts = by_unit[unit.name]
            began = min(r.began for _, r in parts)
            # a move is done when its last receiver holds its slices (senders return after)
            ended = max(
                r.ended for i, r in parts if unit.kind == "call" or i.group.key == unit.groups[1]
            )
            if unit.kind == "call":
                self._report_call(out, unit, [r for _, r in parts], began, ended)
            else:
                self._report_move(out, unit, [r for _, r in parts], began, ended)
        if not self.evaluate:
            self._report_versions(out, step, by_unit)
        return out

    def _report_versions(
        self, out: StepOutcome, step: int, by_unit: dict[str, list[tuple[NodeInfo, Any]]]
    ) -> None:
        """Each policy generation's weights version (the step whose update made them, as its
        ranks report it: on a copy, what its move's sender held) in its span and the stats:
        ``async/staleness`` is how many updates they lag the on-policy version ``step - 1``."""
        trained = {c.role for c in self.graph.calls if c.kind == "train"}
        spans = {s.name: s for s in out.spans}
        lags = []
        for c in self.graph.calls:
            if c.kind != "generate" or c.role not in trained:
                continue
            version = min(r.version for _, r in by_unit[c.name])
            spans[c.name].args.update(version=version, staleness=step - 1 - version)
            lags.append(step - 1 - version)
        if lags:
            out.stats["async/staleness"] = float(max(lags))
            out.stats["async/policy_version"] = float(step - 1 - max(lags))
            for lag in range(self.staleness + 1):  # the histogram: each bound's share of calls
                out.stats[f"async/staleness_{lag}"] = lags.count(lag) / len(lags)

    def _report_call(
        self, out: StepOutcome, unit: Unit, results: list[CallResult], began: float, ended: float
    ) -> None:
        group = self.placement.groups[unit.groups[0]]
        out.stats.update(results[0].stats)
        out.compute_seconds[unit.name] = max(r.seconds for r in results)
        peak = max(r.peak_bytes for r in results)  # the fullest device's (0: not measured)
        if peak:
            out.peak_bytes[unit.name] = peak
        out.wall_seconds[unit.name] = ended - began
        engine = {"engine": results[0].engine}  # the backend every rank of the call ran
        out.spans.append(
            TraceSpan(unit.name, "call", unit.role, group.layout.name, group.key, began, ended,
                      engine)
        )  # fmt: skip

    def _report_move(
        self, out: StepOutcome, unit: Unit, results: list[MoveResult], began: float, ended: float
    ) -> None:
        src, dst = (self.placement.groups[k] for k in unit.groups)
        moved = sum(r.bytes for r in results)
        what = unit.name.removeprefix("realloc:")
        key = f"{unit.role}_ema" if unit.name.startswith("ema:") else what
        out.reallocs[key] = ReallocStats(ended - began, moved)
        layouts = f"{src.layout.name} -> {dst.layout.name}"
        out.spans.append(
            TraceSpan(
                unit.name, "realloc", unit.role, layouts, dst.key, began, ended, {"bytes": moved}
            )
        )

    def pending(self, refs: list[Any]) -> list[Pending]:
        """Each node's ref with its actor and unit, for ``waits.gather``."""
        phase = "eval " if self.evaluate else ""
        return [
            pending(ref, n.info.actor, n.info.group.role, n.info.actor_name, phase + n.info.doing)
            for ref, n in zip(refs, self.nodes, strict=True)
        ]

    def failure(self, error: ray.exceptions.RayActorError) -> RunFailed:
        """A run-stopping error naming the dead actor, its role and the unit it was running
        (the compiled executor's one result)."""
        return died(error, self.pending([None] * len(self.nodes)), set())


@dataclass
class Submitted:
    """A step handed to the actors and not yet collected."""

    step: int
    batch: PackedBatch
    dag: StepDag
    refs: list[Any]  # plain: one object ref per node; compiled: the compiled graph's ref


class DagExecutor:
    """Runs each step's DAG with plain actor calls or as a Ray compiled graph; with
    ``overlap`` (plain calls only) a step may be submitted before the previous one is
    collected, and runs as soon as its dataflow allows; with ``staleness`` k the leading part of
    a step (``submit(..., part="lead")``) goes k periods before the rest."""

    def __init__(
        self,
        graph: Graph,
        placement: Placement,
        compiled: bool = False,
        timeout_s: float = 3600,
        overlap: bool = False,
        staleness: int = 0,
    ) -> None:
        assert not (compiled and (overlap or staleness)), "a compiled graph runs one step at a time"
        self.graph, self.placement = graph, placement
        self.compiled, self.timeout_s, self.overlap = compiled, timeout_s, overlap
        self.staleness = staleness
        self._dags: dict[bool, StepDag] = {}
        self._live: tuple[bool, Any] | None = None  # (evaluate, CompiledDAG)
        self._open: dict[int, list[Any]] = {}  # step -> its node refs, until it is collected

    def dag(self, evaluate: bool) -> StepDag:
        if evaluate not in self._dags:
            self._dags[evaluate] = StepDag(self.graph, self.placement, evaluate, self.staleness)
        return self._dags[evaluate]

    def submit(
        self,
        step: int,
        batch: PackedBatch,
        evaluate: bool = False,
        part: Literal["all", "lead"] = "all",
    ) -> Submitted:
        """Hand one iteration to the actors; with ``evaluate`` train calls report metrics
        instead of updating. ``part="lead"`` submits only the step's leading units (the rest
        follows with a later ``submit``: the one to collect). Without ``overlap`` the previous
        step must be collected first."""
        dag = self.dag(evaluate)
        step_input = StepInput(step, batch)
        if part == "lead" and not dag.leading:
            return Submitted(step, batch, dag, [])  # nothing runs ahead (max_staleness: 0)
        if self.compiled:
            return Submitted(step, batch, dag, [self._execute_compiled(dag, step_input)])
        if evaluate:
            refs = [None] * len(dag.nodes)
            dag.submit(step_input, refs, list(range(len(refs))))
            return Submitted(step, batch, dag, refs)
        refs = self._open.setdefault(step, [None] * len(dag.nodes))
        which = dag.leading if part == "lead" else [i for i, r in enumerate(refs) if r is None]
        dag.submit(step_input, refs, which, self._open.get)
        return Submitted(step, batch, dag, refs)

    def collect(self, submitted: Submitted) -> StepOutcome:
        """Wait for a submitted step; its batch, stats, timings and spans."""
        dag = submitted.dag
        if self.compiled:
            try:
                results = ray.get(submitted.refs[0], timeout=self.timeout_s)
            except ray.exceptions.RayActorError as e:
                raise dag.failure(e) from e
            except ray.exceptions.RayTaskError as e:
                raise_user_error(e)
                raise
            except ray.exceptions.GetTimeoutError as e:
                raise RunFailed(
                    f"step {submitted.step} did not finish within {self.timeout_s:g} s "
                    f"(driver.call_timeout_s)"
                ) from e
        else:
            results = gather(dag.pending(submitted.refs), self.timeout_s)
            if not dag.evaluate:
                self._open.pop(submitted.step, None)
        return dag.outcome(submitted.step, submitted.batch, results)

    def run_step(self, step: int, batch: PackedBatch, evaluate: bool = False) -> StepOutcome:
        """One iteration, submitted and collected."""
        return self.collect(self.submit(step, batch, evaluate))

    def _execute_compiled(self, dag: StepDag, step_input: StepInput) -> Any:
        if self._live is not None and self._live[0] != dag.evaluate:
            self.close()  # one compiled graph at a time holds the actors
        if self._live is None:
            compiled = dag.ray_dag().experimental_compile(_submit_timeout=self.timeout_s)
            self._live = (dag.evaluate, compiled)
        try:
            return self._live[1].execute(step_input)
        except ray.exceptions.RayActorError as e:
            raise dag.failure(e) from e

    def close(self) -> None:
        """Tear down the compiled graph (the actors take plain calls again); the next step
        follows no earlier one."""
        self._open.clear()
        if self._live is not None:
            compiled, self._live = self._live[1], None
            with contextlib.suppress(Exception):  # a dead actor must not stop the teardown
                compiled.teardown()
