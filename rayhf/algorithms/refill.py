"""What a step that refills its batch keeps: ``GroupRefill``, the rule of dynamic sampling.

The runtime (``rayhf.runtime.refill``) runs the graph's calls up to the one writing
``split_key`` round after round and asks this object which samples to keep; it names no key
itself. A group (the samples of one prompt, ``group_ids``) is kept when its scores are not all
equal: a group that scores alike has advantage 0 and teaches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayhf.algorithms.lm import rollout_means
from rayhf.algorithms.seqs import informative_groups
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.graph import Graph


@dataclass(frozen=True)
class GroupRefill:
    """Keep the groups whose scores differ, over at most ``rounds`` generations a step."""

    rounds: int
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

    def policy_stats(self, batch: PackedBatch) -> dict[str, float]:
        """``task_reward`` and ``response_len`` of a round's whole batch, before the filter."""
        return rollout_means(batch)
