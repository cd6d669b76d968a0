"""Dynamic sampling: a step whose batch is refilled until its groups teach something.

    the graph, split after the call that writes the refill's ``split_key`` (the scores):
      lead (generate, score) on the step's rows  --> keep what the algorithm's refill keeps
        (``rayhf.algorithms.refill``: the groups whose scores differ); while fewer than
        ``batch_size`` groups are kept and the refill's limit is not reached (``rounds``
        generations; unset: a whole dataset's worth of rows drawn this step): lead again on
        the next rows of the dataset (``batch_size`` more: a round is the planned generation)
      at the limit with fewer kept: the refill's ``short_batch`` raises (the default), or
        logs a warning and lets the step train on the groups kept (at least one)
      rest (reference, train) on the first ``batch_size`` groups kept, as its step input

Both parts run on the run's role groups in the plan's layouts, each a plain ``DagExecutor``, so
the calls are the planned ones; a refill round repeats the lead part's calls (and their weight
moves). The planner prices one round: a step's lead part costs what it priced times the rounds
it took, which the metrics report (``dynamic/rounds``). Steps do not overlap. A step never
trains on groups that all scored alike.

Metrics: ``dynamic/rounds``, ``dynamic/dropped_share`` (groups dropped over groups generated),
``dynamic/filled`` (groups trained over ``batch_size``: below 1 only with ``short_batch:
train``), and ``task_reward`` and ``response_len`` of the first round (the policy's, before any
filter); the train call's ``task_reward`` of the groups it trained on becomes
``dynamic/trained_task_reward``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from rayhf.algorithms.refill import GroupRefill, Progress
from rayhf.data.batch import PackedBatch
from rayhf.graph import Graph
from rayhf.realloc.mover import ReallocStats
from rayhf.runtime.driver import DagExecutor, Placement, StepOutcome, Submitted

log = logging.getLogger(__name__)


class RefillExecutor:
    """``DagExecutor``'s interface for a run with dynamic sampling: ``rows(n)`` gives the next
    ``n`` of the dataset's ``dataset_rows`` rows for a refill; evaluation runs the whole graph as
    usual."""

    overlap = False
    staleness = 0

    def __init__(
        self,
        graph: Graph,
        placement: Placement,
        timeout_s: float,
        batch_size: int,
        refill: GroupRefill,
        rows: Callable[[int], PackedBatch],
        dataset_rows: int,
    ) -> None:
        self.whole = DagExecutor(graph, placement, timeout_s=timeout_s)
        lead, rest = graph.split_after(refill.split_key)
        self.lead = DagExecutor(lead, placement, timeout_s=timeout_s)
        self.rest = DagExecutor(rest, placement, timeout_s=timeout_s)
        self.batch_size, self.refill, self.rows = batch_size, refill, rows
        self.dataset_rows = dataset_rows

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
        rounds, batch, stats = self._fill(submitted.step, submitted.batch)
        return _merged(rounds, self.rest.run_step(submitted.step, batch), stats)

    def _fill(
        self, step: int, rows: PackedBatch
    ) -> tuple[list[StepOutcome], PackedBatch, dict[str, float]]:
        """Lead rounds until the refill says stop: every round's outcome, the groups kept (the
        rest's input) and the refill's metrics."""
        kept: list[PackedBatch] = []
        rounds: list[StepOutcome] = []
        generated = useful = n_kept = n_rows = 0
        while True:
            done = self.lead.run_step(step, rows)
            rounds.append(done)
            part, n, u = self.refill.keep(done.batch, self.batch_size - n_kept)
            kept.append(part)
            generated, useful = generated + n, useful + u
            n_kept += self.refill.count(part)
            n_rows += rows.n_samples
            now = Progress(step, n_kept, len(rounds), n_rows)
            move = self.refill.next_move(now, self.batch_size, self.dataset_rows)
            if move != "refill":
                break
            rows = self.rows(self.batch_size)  # a round is the planned generation
        if move == "short":
            log.warning(
                "step %d trains on %d of batch_size %d groups: dynamic sampling kept no more "
                "in %d rounds (algorithm.short_batch: train)",
                step,
                n_kept,
                self.batch_size,
                len(rounds),
            )
        stats = {
            **self.refill.policy_stats(rounds[0].batch),
            "dynamic/dropped_share": 1.0 - useful / generated if generated else 0.0,
            "dynamic/filled": n_kept / self.batch_size,
        }
        return rounds, PackedBatch.concat([k for k in kept if k.n_samples]), stats

    def run_step(self, step: int, batch: PackedBatch, evaluate: bool = False) -> StepOutcome:
        return self.collect(self.submit(step, batch, evaluate))

    def close(self) -> None:
        for executor in (self.whole, self.lead, self.rest):
            executor.close()


def _merged(rounds: list[StepOutcome], out: StepOutcome, refill: dict[str, float]) -> StepOutcome:
    """The step's outcome: the rest's, with every round's timings and spans, and the refill's
    metrics (its policy stats replace the train call's, kept as ``dynamic/trained_<key>``)."""
    stats: dict[str, Any] = dict(out.stats)
    for key in refill:
        if key in stats:
            stats[f"dynamic/trained_{key}"] = stats[key]
    stats.update({**refill, "dynamic/rounds": float(len(rounds))})
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
