"""RLOO's math on hand-computed cases (Ahmadian et al., 2024, eq. for the leave-one-out
baseline; the KL-penalized reward as TRL's RLOO forms it), its advantages over data-parallel
ranks, and that a graph of another algorithm refuses its config."""

from __future__ import annotations

import pytest
import torch
from algo_support import GARBAGE, LENGTHS, _mask, _rand

from rayhf.algorithms.interface import InterfaceSettings
from rayhf.algorithms.rloo import RLOOActorInterface, RLOOConfig, kl_rewards, loo_advantages
from rayhf.data.batch import PackedBatch
from rayhf.sampling import GenerationConfig


def test_each_reward_is_compared_with_the_mean_of_the_others_of_its_prompt():
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0, 1.0, 2.0], dtype=torch.float64)
    groups = torch.tensor([3, 3, 8, 3, 3, 4])  # group 3: 1, 0, 0, 1; 8 and 4 alone
    adv = loo_advantages(rewards, groups)
    # 1 - (0 + 0 + 1) / 3 and 0 - (1 + 0 + 1) / 3; a group of one has no baseline
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, 0.0, -2 / 3, 2 / 3, 0.0])
    # the same as k / (k - 1) * (r - mean): GRPO's centring, rescaled, no std
    assert adv[[0, 1]].tolist() == pytest.approx([4 / 3 * 0.5, 4 / 3 * -0.5])


def test_the_kl_comes_out_of_the_reward_summed_over_the_response():
    logp, ref = _rand(1), _rand(2)
    mask = _mask(LENGTHS)
    got = kl_rewards(torch.ones(len(LENGTHS), dtype=torch.float64), logp, ref, mask, 0.1)
    for i, n in enumerate(LENGTHS):
        ratio = sum(logp[i, t].item() - ref[i, t].item() for t in range(n))
        assert got[i].item() == pytest.approx(1.0 - 0.1 * ratio)  # padding (GARBAGE) left out
    assert abs(got).max() < GARBAGE


class _TwoRanks:
    def __init__(self, other: object, rank: int) -> None:
        self.other, self.rank = other, rank

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def _rollouts(ids: list[int], groups: list[int], scores: list[float], logps: list[list[float]]):
    b = PackedBatch(ids)
    seqs = [[1, 2, *range(len(lp))] for lp in logps]  # a 2-token prompt, then the response
    b.add("seq", torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    b.add("prompt_lens", torch.tensor([2] * len(ids)), [1] * len(ids))
    flat = [x for lp in logps for x in lp]
    b.add("logprobs", torch.tensor(flat), [len(lp) for lp in logps])
    b.add("ref_logprobs", torch.zeros(len(flat)), [len(lp) for lp in logps])
    b.add("group_ids", torch.tensor(groups), [1] * len(ids))
    b.add("scores", torch.tensor(scores), [1] * len(ids))
    return b


def test_advantages_span_the_data_parallel_ranks_and_the_loss_has_no_kl_term():
    cfg = RLOOConfig(group_size=2, kl_coef=0.5)
    iface = RLOOActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    rank0 = _rollouts([0], [7], [1.0], [[-1.0, -1.0]])  # reward 1 - 0.5 * (-2) = 2
    rank1 = _rollouts([1], [7], [1.0], [[-0.5]])  # reward 1 - 0.5 * (-0.5) = 1.25
    parts = []
    for b in (rank0, rank1):
        rewards = [2.0] if b is rank0 else [1.25]
        parts.append((b.tensors["group_ids"].long(), torch.tensor(rewards)))
    assert iface.advantages(_TwoRanks(parts[1], 0), rank0, 0).tolist() == pytest.approx([0.75])
    assert iface.advantages(_TwoRanks(parts[0], 1), rank1, 1).tolist() == pytest.approx([-0.75])
    assert iface.loss_config.kl_coef == 0.0 and cfg.kl_coef == 0.5
