"""pass@k (``rayhf.rewards.passk``): the unbiased estimator against brute force, and its grouping
of held-out answers by prompt."""

from __future__ import annotations

import itertools
from math import comb

import pytest
import torch

from rayhf.data.batch import PackedBatch
from rayhf.rewards.passk import pass_at_k, pass_at_k_metrics, reported_ks


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (8, 8), (7, 0)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_answer(n, c):
    answers = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(answers, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute)
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))


def test_reported_ks_are_one_powers_of_two_and_n():
    assert reported_ks(1) == [1] and reported_ks(4) == [1, 2, 4] and reported_ks(6) == [1, 2, 4, 6]


def _scored(ids: list[int], scores: list[float], groups: list[int] | None = None) -> PackedBatch:
    b = PackedBatch(ids)
    b.add("scores", torch.tensor(scores), [1] * len(ids))
    if groups is not None:
        b.add("group_ids", torch.tensor(groups), [1] * len(ids))
    return b


def test_answers_are_grouped_by_their_held_out_row():
    # 2 rows x 2 copies, one answer each (PPO): row 0 has 1 of 2 right, row 1 none
    ppo = _scored([0, 1, 2, 3], [1.0, 0.2, 0.0, 0.99])
    got = pass_at_k_metrics(ppo, copies=2, correct_at=1.0)
    assert got == pytest.approx({"pass@1": 0.25, "pass@2": 0.5, "task_reward": 0.5475})
    # GRPO: 2 rows x 1 copy x group of 3 (new ids; group_ids = the row's sample id)
    grpo = _scored([0, 1, 2, 3, 4, 5], [1, 1, 0, 0, 0, 1], groups=[0, 0, 0, 1, 1, 1])
    got = pass_at_k_metrics(grpo, copies=1, correct_at=0.5)
    expected = {"pass@1": 0.5, "pass@2": (1.0 + 2 / 3) / 2, "pass@3": 1.0, "task_reward": 0.5}
    assert got == pytest.approx(expected)
    assert pass_at_k_metrics(PackedBatch([0]), copies=1, correct_at=1.0) == {}, "nothing scored"
