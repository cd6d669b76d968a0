"""REINFORCE++'s math (Hu, 2025) on hand-computed cases: the undiscounted return of KL-shaped
token rewards, the normalization over every rank's tokens, the baseline variant's group-centred
advantages, and the settings it refuses."""

from __future__ import annotations

import math

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
    # no valid token on any rank: zeros, not NaN
    empty = torch.zeros(2, 3, dtype=torch.bool)
    none = global_whiten(_Ranks(), torch.full((2, 3), 5.0), empty)  # type: ignore[arg-type]
    assert torch.equal(none, torch.zeros(2, 3))


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


def _multi_turn(scores: list[float], group_ids: list[int] | None = None) -> PackedBatch:
    """Two samples after a 2-token prompt: a multi-turn one whose response tokens 1 and 2 are
    the environment's (``loss_mask`` [1, 0, 0, 1], log-probs 9 there, which must not count), and
    a plain one of two tokens."""
    b = PackedBatch([0, 1])
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4]]
    b.add("seq", torch.tensor([t for s in seqs for t in s]), [6, 4])
    b.add("prompt_lens", torch.tensor([2, 2]), [1, 1])
    b.add("loss_mask", torch.tensor([1, 0, 0, 1, 1, 1], dtype=torch.bool), [4, 2])
    b.add("logprobs", torch.tensor([0.5, 9.0, 9.0, 0.2, 0.0, 0.0]), [4, 2])
    b.add("ref_logprobs", torch.zeros(6), [4, 2])
    b.add("scores", torch.tensor(scores), [1, 1])
    if group_ids is not None:
        b.add("group_ids", torch.tensor(group_ids), [1, 1])
    return b


def test_a_multi_turn_sample_s_returns_run_over_its_model_tokens_only():
    cfg = ReinforcePPConfig(kl_coef=0.1)
    iface = ReinforcePPActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    b = _multi_turn([1.0, 0.0])
    iface.add_advantages(_Ranks(), b, 0)  # type: ignore[arg-type]
    # trained rewards: -0.1 * 0.5 | 1 - 0.1 * 0.2 -> returns 0.93, 0.98; the other row 0, 0
    returns = torch.tensor([0.93, 0.98, 0.0, 0.0], dtype=torch.float64)
    want = (returns - returns.mean()) / returns.std(unbiased=False)
    assert b.seqlens["advantages"] == [4, 2]  # one entry per response token
    adv = padded(b, "advantages")
    assert adv[0].tolist() == pytest.approx([want[0].item(), 0.0, 0.0, want[1].item()], rel=1e-5)
    assert adv[1, :2].tolist() == pytest.approx(want[2:].tolist(), rel=1e-5)


def test_the_baseline_variant_puts_a_multi_turn_advantage_on_its_model_tokens():
    cfg = ReinforcePPConfig(baseline=True, group_size=2)
    iface = ReinforcePPActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    b = _multi_turn([1.0, 0.0], group_ids=[5, 5])
    iface.add_advantages(_Ranks(), b, 0)  # type: ignore[arg-type]
    # centred 0.5 on the two model tokens of row 0, -0.5 on row 1's two: whitened to +-1
    assert b.seqlens["advantages"] == [4, 2]
    adv = padded(b, "advantages")
    assert adv[0].tolist() == pytest.approx([1.0, 0.0, 0.0, 1.0], rel=1e-5)
    assert adv[1, :2].tolist() == pytest.approx([-1.0, -1.0], rel=1e-5)


def test_the_baseline_variant_s_kl_term_is_k2_by_default():
    cfg = ReinforcePPConfig(baseline=True, group_size=2, kl_coef=0.5)
    assert cfg.kl_estimator == "k2"
    iface = ReinforcePPActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    logp = torch.tensor([[-1.0, -2.0, 7.0], [-0.5, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    # advantage 0 and old == new: the surrogate is 0, the loss is only the KL term;
    # d = 0.5, -1, 0 over the three valid tokens -> mean of d^2 / 2 = (0.125 + 0.5 + 0) / 3
    loss, stats = iface.policy_loss(logp, logp, ref, torch.zeros(2, 3), mask, None)
    assert loss.item() == pytest.approx(0.5 * 0.625 / 3)
    assert stats["kl"] == pytest.approx(0.625 / 3)


@pytest.mark.parametrize(
    ("how", "per_token"),
    [("k1", [0.5, -1.0, 0.0]), ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1) - 1 - 1, 0.0])],
)
def test_the_baseline_variant_s_kl_term_is_selectable(how: str, per_token: list[float]):
    cfg = ReinforcePPConfig(baseline=True, group_size=2, kl_coef=1.0, kl_estimator=how)
    iface = ReinforcePPActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    logp, ref = torch.tensor([[-1.0, -2.0], [-0.5, 3.0]]), torch.tensor([[-1.5, -1.0], [-0.5, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    loss, _ = iface.policy_loss(logp, logp, ref, torch.zeros(2, 2), mask, None)
    assert loss.item() == pytest.approx(sum(per_token) / 3, rel=1e-6)
