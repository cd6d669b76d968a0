"""What a step that refills its batch keeps, and when it stops: ``GroupRefill``, the rule of
dynamic sampling.

The runtime (``rayhf.runtime.refill``) runs the graph's calls up to the one writing
``split_key`` round after round, asks this object which samples to keep and, after each round,
what to do next (``next_move``); it names no key and decides nothing itself. A group (the
samples of one prompt, ``group_ids``) is kept when its scores are not all equal: a group that
scores alike has advantage 0 and teaches nothing.

A step refills until ``batch_size`` groups are kept or it reaches its limit: ``rounds``
generations when set, else a whole dataset's worth of rows drawn (the rows would repeat, and a
reward that never tells a group's samples apart would refill forever). At the limit with the
batch short, ``short_batch`` decides: ``error`` stops the run, ``train`` trains on the groups
kept (none kept is an error either way: there is nothing to train on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rayhf.algorithms.lm import rollout_means
from rayhf.algorithms.seqs import informative_groups
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.graph import Graph

ShortBatch = Literal["error", "train"]
NextMove = Literal["refill", "full", "short"]  # short: train on fewer than batch_size groups


@dataclass(frozen=True)
class Progress:
    """Where a step's refill stands after a round."""

    step: int
    kept: int  # groups kept so far
    rounds: int  # generations run, the first included
    rows: int  # dataset rows drawn, the first round's included


@dataclass(frozen=True)
class GroupRefill:
    """Keep the groups whose scores differ, refilling until ``batch_size`` are kept or the
    limit (``rounds`` generations; None: a whole dataset's worth of rows)."""

    rounds: int | None = None
    short_batch: ShortBatch = "error"  # at the limit with the batch short: stop, or train on it
    split_key: str = "scores"  # the graph splits after the call that writes it
    group_key: str = "group_ids"

    def check(self, graph: Graph) -> None:
        """Refuse a graph without the groups and scores to filter on."""
        missing = [k for k in (self.split_key, self.group_key) if k not in graph.producers]
        if missing:
            raise RayhfError(
                f"algorithm.dynamic_sampling filters groups by their scores: graph "
                f"'{graph.name}' makes no '{missing[0]}'; use a graph with group scores or "
                "dynamic_sampling: false"
            )

    def count(self, batch: PackedBatch) -> int:
        """The groups in ``batch``."""
        return len(set(batch.tensors[self.group_key].tolist())) if batch.n_samples else 0

    def keep(self, batch: PackedBatch, n_groups: int) -> tuple[PackedBatch, int, int]:
        """The samples of ``batch``'s first ``n_groups`` informative groups; how many groups it
        held, and how many of them were informative."""
        ids = batch.tensors[self.group_key]
        keep = informative_groups(batch.tensors[self.split_key], ids)
        order = list(dict.fromkeys(ids.tolist()))
        useful = [g for g in order if keep[ids == g].all()]
        chosen = set(useful[:n_groups])
        part = batch.select([i for i, g in enumerate(ids.tolist()) if g in chosen])
        return part, len(order), len(useful)

    def next_move(self, now: Progress, batch_size: int, dataset_rows: int) -> NextMove:
        """After a round: ``full``, another round (``refill``), or at the limit with the batch
        short, ``short`` (``short_batch: train``) or a ``RayhfError`` that says what to change."""
        if now.kept >= batch_size:
            return "full"
        at_limit = now.rows >= dataset_rows if self.rounds is None else now.rounds >= self.rounds
        if not at_limit:
            return "refill"
        if self.short_batch == "train" and now.kept:
            return "short"
        raise RayhfError(self._short_message(now, batch_size, dataset_rows))

    def _short_message(self, now: Progress, batch_size: int, dataset_rows: int) -> str:
        """Why step ``now.step`` stops short, naming the setting to change."""
        had = (
            f"step {now.step} kept {now.kept} of batch_size {batch_size} groups whose scores "
            f"differ after {now.rounds} rounds"
        )
        alike = "check that the reward can tell a group's samples apart"
        if self.rounds is None:
            short = ", set algorithm.short_batch: train" if now.kept else ""
            return (
                f"algorithm.dynamic_sampling (max_rounds: null): {had} and {now.rows} rows, the "
                f"whole dataset's {dataset_rows}; {alike}{short} or set dynamic_sampling: false"
            )
        if self.short_batch == "train":  # and none kept: nothing to train on
            return f"algorithm.max_rounds: {had}, nothing to train on; raise max_rounds or {alike}"
        return (
            f"algorithm.max_rounds: {had}; raise max_rounds, set it to null (refill until "
            "full) or set algorithm.short_batch: train"
        )

    def policy_stats(self, batch: PackedBatch) -> dict[str, float]:
        """``task_reward`` and ``response_len`` of a round's whole batch, before the filter."""
        return rollout_means(batch)
