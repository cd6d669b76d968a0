"""A step with dynamic sampling (``rayhf.runtime.refill``) over fake lead and rest executors:
which rounds run, what the train part gets, when a short batch stops the run or trains with a
warning, and that an unlimited refill stops after a whole dataset's worth of rows. No Ray is
started: the executors' actor calls are replaced by scripted rounds."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rayhf.algorithms.refill import GroupRefill
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.runtime.driver import StepOutcome
from rayhf.runtime.refill import RefillExecutor

DAPO = load_graph(Path(__file__).parents[3] / "graphs" / "dapo.yaml")
GROUP = 2  # samples per prompt
STEP = 7


def rows(ids: list[int]) -> PackedBatch:
    """Dataset rows: one prompt token each."""
    batch = PackedBatch(ids)
    batch.add("prompts", torch.tensor([1] * len(ids)), [1] * len(ids))
    return batch


class FakeLead:
    """Generates and scores: ``GROUP`` samples per row, whose scores differ for the rows in
    ``differ`` (all 0 otherwise)."""

    def __init__(self, differ: set[int]) -> None:
        self.differ, self.calls = differ, 0

    def run_step(self, step: int, batch: PackedBatch) -> StepOutcome:
        assert step == STEP
        self.calls += 1
        ids = [r * GROUP + j for r in batch.sample_ids for j in range(GROUP)]
        out = PackedBatch(ids)
        groups = [r for r in batch.sample_ids for _ in range(GROUP)]
        scores = [
            float(j) if r in self.differ else 0.0 for r in batch.sample_ids for j in range(GROUP)
        ]
        out.add("seq", torch.tensor([5, 6, 7] * len(ids)), [3] * len(ids))
        out.add("prompt_lens", torch.tensor([1] * len(ids)), [1] * len(ids))
        out.add("group_ids", torch.tensor(groups), [1] * len(ids))
        out.add("scores", torch.tensor(scores), [1] * len(ids))
        return StepOutcome(out, stats={"task_reward": -1.0})  # replaced by the refill's


class FakeRest:
    """Trains: records the batch it is given."""

    def __init__(self) -> None:
        self.batches: list[PackedBatch] = []

    def dag(self, evaluate: bool) -> SimpleNamespace:
        return SimpleNamespace(evaluate=evaluate)

    def run_step(self, step: int, batch: PackedBatch) -> StepOutcome:
        self.batches.append(batch)
        return StepOutcome(batch, stats={"task_reward": 0.5, "loss": 1.0})


def executor(
    refill: GroupRefill, differ: set[int], dataset_rows: int = 64, batch_size: int = 4
) -> RefillExecutor:
    """A refill executor on the DAPO graph whose lead and rest are fakes; the dataset hands out
    rows from ``batch_size`` on (the step's own rows are ``0..batch_size - 1``)."""
    drawn = iter(range(batch_size, 10**6))

    def next_rows(n: int) -> PackedBatch:
        return rows([next(drawn) for _ in range(n)])

    ex = RefillExecutor(DAPO, None, 10.0, batch_size, refill, next_rows, dataset_rows)  # type: ignore[arg-type]
    ex.lead, ex.rest = FakeLead(differ), FakeRest()  # type: ignore[assignment]
    return ex


# the hand case: rounds of rows 0-3, 4-7, 8-11 keep groups 0 and 5 only; 13 and 14 differ later
HAND = {0, 5, 13, 14}


def step(ex: RefillExecutor) -> StepOutcome:
    return ex.run_step(STEP, rows([0, 1, 2, 3]))


def test_a_configured_limit_with_the_batch_short_stops_naming_max_rounds():
    ex = executor(GroupRefill(rounds=3), HAND)
    with pytest.raises(RayhfError, match=r"^algorithm.max_rounds: step 7 kept 2 of batch_size 4 "):
        step(ex)
    assert ex.lead.calls == 3 and not ex.rest.batches  # type: ignore[attr-defined]


def test_short_batch_train_trains_on_the_groups_kept_and_says_so(caplog):
    ex = executor(GroupRefill(rounds=3, short_batch="train"), HAND)
    with caplog.at_level(logging.WARNING, logger="rayhf.runtime.refill"):
        out = step(ex)
    (trained,) = ex.rest.batches  # type: ignore[attr-defined]
    assert trained.tensors["group_ids"].tolist() == [0, 0, 5, 5]
    assert out.stats["dynamic/filled"] == 0.5 and out.stats["dynamic/rounds"] == 3
    assert out.stats["dynamic/dropped_share"] == pytest.approx(1 - 2 / 12)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "step 7 trains on 2 of batch_size 4 groups" in warning.getMessage()
    assert "algorithm.short_batch: train" in warning.getMessage()


def test_no_limit_refills_until_the_batch_is_full(caplog):
    ex = executor(GroupRefill(), HAND)
    with caplog.at_level(logging.WARNING):
        out = step(ex)
    (trained,) = ex.rest.batches  # type: ignore[attr-defined]
    assert trained.tensors["group_ids"].tolist() == [0, 0, 5, 5, 13, 13, 14, 14]
    assert out.stats["dynamic/filled"] == 1.0 and out.stats["dynamic/rounds"] == 4
    assert out.stats["task_reward"] == 1 / 8  # the first round's scores, before the filter
    assert out.stats["dynamic/trained_task_reward"] == 0.5
    assert not caplog.records


def test_a_full_first_round_trains_its_first_batch_size_groups():
    ex = executor(GroupRefill(rounds=1), set(range(8)))
    out = step(ex)
    assert ex.rest.batches[0].tensors["group_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # type: ignore[attr-defined]
    assert out.stats["dynamic/rounds"] == 1 and out.stats["dynamic/dropped_share"] == 0.0


def test_no_limit_stops_after_a_whole_dataset_of_rows_when_no_group_can_differ():
    ex = executor(GroupRefill(), set(), dataset_rows=12)  # a constant reward
    says = r"^algorithm.dynamic_sampling \(max_rounds: null\): step 7 kept 0 of batch_size 4 "
    with pytest.raises(RayhfError, match=says + r".* 12 rows, the whole dataset's 12; "):
        step(ex)
    assert ex.lead.calls == 3  # type: ignore[attr-defined]


def test_no_limit_trains_short_at_the_dataset_limit_only_with_short_batch_train():
    with pytest.raises(RayhfError, match=r"set algorithm\.short_batch: train"):
        step(executor(GroupRefill(), HAND, dataset_rows=12))
    ex = executor(GroupRefill(short_batch="train"), HAND, dataset_rows=12)
    assert step(ex).stats["dynamic/filled"] == 0.5


def test_short_batch_train_with_no_group_kept_stops_the_run():
    ex = executor(GroupRefill(rounds=3, short_batch="train"), set())
    with pytest.raises(RayhfError, match=r"^algorithm.max_rounds: .* kept 0 .* nothing to train"):
        step(ex)
    assert not ex.rest.batches  # type: ignore[attr-defined]
