"""REINFORCE++'s math (Hu, 2025) on hand-computed cases: the undiscounted return of KL-shaped
token rewards, the normalization over every rank's tokens, the baseline variant's group-centred
advantages, and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rayhf.algorithms.interface import InterfaceSettings
from rayhf.algorithms.lm import padded
from rayhf.algorithms.ppo import global_whiten
from rayhf.algorithms.reinforce_pp import (
    ReinforcePPActorInterface,
    ReinforcePPConfig,
    reinforce_pp_advantages,
    token_returns,
)
from rayhf.data.batch import PackedBatch
from rayhf.sampling import GenerationConfig

MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)


def test_the_return_sums_the_rewards_from_each_token_on():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0], [7.0, 7.0, 7.0]])
    assert token_returns(rewards, MASK).tolist() == [[6, 5, 3], [9, 5, 0], [0, 0, 0]]


def test_the_score_comes_last_and_the_kl_on_every_token():
    logp = torch.tensor([[0.5, -0.2, 0.1], [0.0, 0.3, 9.0], [0.0, 0.0, 0.0]])
    got = reinforce_pp_advantages(torch.tensor([1.0, 2.0, 5.0]), logp, torch.zeros(3, 3), MASK, 0.1)
    # rewards: -0.1 * kl per token, plus the score on the last; returns summed from t on
    assert got[0].tolist() == pytest.approx([0.96, 1.01, 0.99])
    assert got[1].tolist() == pytest.approx([1.97, 1.97, 0.0]) and got[2].abs().sum() == 0


class _Ranks:
    """Rank 0 of two, the other rank's tensors given: sums and gathers include them."""

    def __init__(self, other_sums: torch.Tensor | None = None, other: object = None) -> None:
        self.other_sums, self.other = other_sums, other

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.other_sums is None else t + self.other_sums

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj] if self.other is None else [obj, self.other]


def test_advantages_are_normalized_over_every_rank_s_tokens():
    # PPO's global_whiten, which REINFORCE++ uses
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 50.0], [9.0, 9.0, 9.0]])
    alone = global_whiten(_Ranks(), x, MASK)  # type: ignore[arg-type]
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    expected = (valid - valid.mean()) / valid.std(unbiased=False)
    assert alone[MASK].tolist() == pytest.approx(expected.tolist(), rel=1e-6)
    assert alone[~MASK].abs().sum() == 0
    # another rank holding the tokens 6 and 7: the mean and std of all seven
    other = torch.tensor([13.0, 85.0, 2.0], dtype=torch.float64)
    both = global_whiten(_Ranks(other), x, MASK)  # type: ignore[arg-type]
    everything = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    want = (valid - everything.mean()) / everything.std(unbiased=False)
    assert both[MASK].tolist() == pytest.approx(want.tolist(), rel=1e-6)


def test_the_baseline_variant_centres_each_score_on_its_group():
    cfg = ReinforcePPConfig(baseline=True, group_size=2, kl_coef=0.0)
    iface = ReinforcePPActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    b = PackedBatch([0, 1, 2, 3])
    seqs = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]]  # 1 or 2 response tokens
    b.add("seq", torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    b.add("prompt_lens", torch.tensor([2, 2, 2, 2]), [1] * 4)
    b.add("group_ids", torch.tensor([0, 0, 1, 1]), [1] * 4)
    b.add("scores", torch.tensor([1.0, 0.0, 3.0, 3.0]), [1] * 4)
    iface.add_advantages(_Ranks(), b, 0)  # type: ignore[arg-type]
    adv = padded(b, "advantages")
    centred = torch.tensor([0.5, -0.5, -0.5, 0.0, 0.0, 0.0])  # per token: 0.5 | -0.5 -0.5 | 0 ..
    want = (centred - centred.mean()) / centred.std(unbiased=False)
    assert adv[0, :1].tolist() + adv[1, :2].tolist() == pytest.approx(want[:3].tolist(), rel=1e-5)


def test_settings_reinforce_pp_refuses():
    with pytest.raises(ValidationError, match="set group_size >= 2"):
        ReinforcePPConfig(baseline=True)
    with pytest.raises(ValidationError, match="dr_grpo"):
        ReinforcePPConfig(dr_grpo=True)
    assert ReinforcePPConfig().group_size == 1
