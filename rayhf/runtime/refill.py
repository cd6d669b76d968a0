"""Dynamic sampling: a step whose batch is refilled until its groups teach something.

    the graph, split after the call that writes ``scores`` (``Graph.split_after``):
      lead (generate, score) on the step's rows  --> drop the groups whose scores are all equal
        (``seqs.informative_groups``), keep the rest; while fewer than ``batch_size`` groups
        are kept and fewer than ``refill_rounds`` generations ran: lead again on the next rows of
        the dataset (``batch_size`` more: a round is the planned generation)
      rest (reference, train) on the first ``batch_size`` groups kept, as its step input

Both parts run on the run's role groups in the plan's layouts, each a plain ``DagExecutor``, so
the calls are the planned ones; a refill round repeats the lead part's calls (and their weight
moves). The planner prices one round: a step costs what it priced times the rounds it took,
which the metrics report (``dynamic/rounds``). Steps do not overlap. With no group kept after
every round the step trains on the last round's groups, whose advantages are all 0.

Metrics: ``dynamic/rounds``, ``dynamic/dropped_share`` (groups dropped over groups generated),
``dynamic/filled`` (groups trained over ``batch_size``), and ``task_reward`` and
``response_len`` of the first round (the policy's, before any filter); the train call's
``task_reward`` of the groups it trained on becomes ``dynamic/trained_reward``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from rayhf.algorithms.seqs import informative_groups
from rayhf.data.batch import PackedBatch
from rayhf.graph import Graph
from rayhf.realloc.mover import ReallocStats
from rayhf.runtime.driver import DagExecutor, Placement, StepOutcome, Submitted


def keep_groups(batch: PackedBatch, n_groups: int) -> tuple[PackedBatch, int, int]:
    """The samples of ``batch``'s first ``n_groups`` informative groups; how many groups it
    held, and how many of them were informative."""
    ids = batch.tensors["group_ids"]
    keep = informative_groups(batch.tensors["scores"], ids)
    order = list(dict.fromkeys(ids.tolist()))
    useful = [g for g in order if keep[ids == g].all()]
    chosen = set(useful[:n_groups])
    part = batch.select([i for i, g in enumerate(ids.tolist()) if g in chosen])
    return part, len(order), len(useful)


def _groups(batch: PackedBatch) -> int:
    return len(set(batch.tensors["group_ids"].tolist())) if batch.n_samples else 0


class RefillExecutor:
    """``DagExecutor``'s interface for a run with dynamic sampling: ``rows(n)`` gives the next
    ``n`` dataset rows for a refill; evaluation runs the whole graph as usual."""

    overlap = False
    staleness = 0

    def __init__(
        self,
        graph: Graph,
        placement: Placement,
        timeout_s: float,
        batch_size: int,
        max_rounds: int,
        rows: Callable[[int], PackedBatch],
    ) -> None:
        self.whole = DagExecutor(graph, placement, timeout_s=timeout_s)
        lead, rest = graph.split_after("scores")
        self.lead = DagExecutor(lead, placement, timeout_s=timeout_s)
        self.rest = DagExecutor(rest, placement, timeout_s=timeout_s)
        self.batch_size, self.max_rounds, self.rows = batch_size, max_rounds, rows

    def submit(
        self,
        step: int,
        batch: PackedBatch,
        evaluate: bool = False,
        part: Literal["all", "lead"] = "all",
    ) -> Submitted:
        """Evaluation goes out now; a train step runs when collected (its refills need the
        scores of each round first)."""
        if evaluate:
            return self.whole.submit(step, batch, evaluate=True)
        return Submitted(step, batch, self.rest.dag(False), [] if part == "lead" else [None])

    def collect(self, submitted: Submitted) -> StepOutcome:
        if submitted.dag.evaluate:
            return self.whole.collect(submitted)
        step, rows = submitted.step, submitted.batch
        kept: list[PackedBatch] = []
        rounds: list[StepOutcome] = []
        generated = useful = n_kept = 0
        while True:
            done = self.lead.run_step(step, rows)
            rounds.append(done)
            part, n, u = keep_groups(done.batch, self.batch_size - n_kept)
            kept.append(part)
            generated, useful, n_kept = generated + n, useful + u, n_kept + _groups(part)
            if n_kept >= self.batch_size or len(rounds) == self.max_rounds:
                break
            rows = self.rows(self.batch_size)  # a round is the planned generation
        batch = PackedBatch.concat([k for k in kept if k.n_samples]) if n_kept else done.batch
        out = self.rest.run_step(step, batch)
        dropped = 1.0 - useful / generated if generated else 0.0
        return _merged(rounds, out, dropped, _groups(batch) / self.batch_size)

    def run_step(self, step: int, batch: PackedBatch, evaluate: bool = False) -> StepOutcome:
        return self.collect(self.submit(step, batch, evaluate))

    def close(self) -> None:
        for executor in (self.whole, self.lead, self.rest):
            executor.close()


def _merged(
    rounds: list[StepOutcome], out: StepOutcome, dropped: float, filled: float
) -> StepOutcome:
    """The step's outcome: the rest's, with every round's timings and spans, and the refill's
    metrics."""
    first = rounds[0].batch
    stats: dict[str, Any] = dict(out.stats)
    if "task_reward" in stats:
        stats["dynamic/trained_reward"] = stats["task_reward"]
    lens = torch.tensor(first.seqlens["seq"]) - first.tensors["prompt_lens"]
    stats.update({
        "task_reward": first.tensors["scores"].float().mean().item(),
        "response_len": lens.float().mean().item(),
        "dynamic/rounds": float(len(rounds)),
        "dynamic/dropped_share": dropped,
        "dynamic/filled": filled,
    })  # fmt: skip
    for r in rounds:
        for name, s in r.compute_seconds.items():
            out.compute_seconds[name] = out.compute_seconds.get(name, 0.0) + s
        for name, s in r.wall_seconds.items():
            out.wall_seconds[name] = out.wall_seconds.get(name, 0.0) + s
        for name, m in r.reallocs.items():
            was = out.reallocs.get(name, ReallocStats(0.0, 0))
            out.reallocs[name] = ReallocStats(was.seconds + m.seconds, was.bytes + m.bytes)
        for key, value in r.stats.items():
            stats.setdefault(key, value)
    out.stats = stats
    out.spans = [s for r in rounds for s in r.spans] + out.spans
    return out
