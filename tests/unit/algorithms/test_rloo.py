"""RLOO's math on hand-computed cases (Ahmadian et al., 2024, eq. for the leave-one-out
baseline; the KL-penalized reward as TRL's RLOO forms it), its advantages over data-parallel
ranks, and TRL's sequence-level loss (``ratio_level: sequence``): its value, which responses
clip, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch
from algo_support import GARBAGE, LENGTHS, _close, _mask, _rand
from pydantic import ValidationError

from rayhf.algorithms.grpo import grpo_loss
from rayhf.algorithms.interface import InterfaceSettings
from rayhf.algorithms.rloo import (
    RLOOActorInterface,
    RLOOConfig,
    kl_rewards,
    loo_advantages,
    sequence_ratio_loss,
)
from rayhf.data.batch import PackedBatch
from rayhf.engines.torch_trainer import samples
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


def _seq_case():
    """Four responses: log-ratios summing to 0.3, -0.1, -0.4 and an empty one; padding holds
    GARBAGE, which must not count."""
    mask = _mask([2, 1, 2, 0], 2)
    log_ratio = torch.tensor([[0.1, 0.2], [-0.1, GARBAGE], [-0.2, -0.2], [GARBAGE, GARBAGE]])
    old = torch.zeros(4, 2, dtype=torch.float64)
    logp = torch.where(mask, log_ratio.double(), torch.full_like(old, GARBAGE))
    return logp.requires_grad_(), old, mask


def test_the_sequence_loss_clips_one_ratio_per_response():
    logp, old, mask = _seq_case()
    cfg = RLOOConfig(ratio_level="sequence", dual_clip=None)  # eps_clip 0.2
    adv = torch.tensor([1.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    loss, stats = sequence_ratio_loss(logp, old, adv, mask, cfg)
    # r = e^0.3 = 1.35 > 1.2 with A > 0: clipped, -1.2; r = e^-0.1 inside: -2 e^-0.1;
    # r = e^-0.4 = 0.67 < 0.8 with A < 0: clipped, 0.8; the empty response adds 0; over 4
    want = (-1.2 - 2 * math.exp(-0.1) + 0.8) / 4
    assert loss.item() == pytest.approx(want)
    assert stats["clip_frac"] == pytest.approx(2 / 3)  # of the three non-empty responses
    assert stats["seq_ratio_mean"] == pytest.approx(
        (math.exp(0.3) + math.exp(-0.1) + math.exp(-0.4)) / 3
    )
    loss.backward()
    assert logp.grad is not None
    # the clipped responses get no gradient; the other d/dlogp_t = -A r / 4 on each token
    _close(logp.grad, [[0.0, 0.0], [-2 * math.exp(-0.1) / 4, 0.0], [0.0, 0.0], [0.0, 0.0]])


def test_the_sequence_loss_is_not_the_token_loss_and_dual_clips_a_response():
    logp, old, mask = _seq_case()
    adv = torch.tensor([1.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    seq, _ = sequence_ratio_loss(logp, old, adv, mask, RLOOConfig(dual_clip=None))
    tok, _ = grpo_loss(logp, old, old, adv, mask, RLOOConfig(kl_coef=0.0, dual_clip=None))
    # per token only e^0.2 clips: (-e^0.1 - 1.2 - 2 e^-0.1 + 2 e^-0.2) over 5 tokens
    hand = (-math.exp(0.1) - 1.2 - 2 * math.exp(-0.1) + 2 * math.exp(-0.2)) / 5
    assert tok.item() == pytest.approx(hand) and seq.item() != pytest.approx(hand, abs=0.01)
    # a response whose ratio went to e^2 with A < 0 loses at most dual_clip * |A| = 3
    far = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    one = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = sequence_ratio_loss(far, torch.zeros_like(far), -torch.ones(1), one, RLOOConfig())
    assert loss.item() == pytest.approx(3.0) and stats["dual_clip_frac"] == 1.0


def test_the_interface_takes_the_sequence_loss_and_weighs_by_samples():
    cfg = RLOOConfig(ratio_level="sequence", dual_clip=None)
    iface = RLOOActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    assert iface.loss_weight is samples
    logp, old, mask = _seq_case()
    adv = torch.tensor([1.0, 2.0, -1.0, 5.0], dtype=torch.float64)
    loss, _ = iface.policy_loss(logp, old, old, adv, mask, None)
    assert loss.item() == pytest.approx((-1.2 - 2 * math.exp(-0.1) + 0.8) / 4)
    token = RLOOActorInterface(InterfaceSettings(RLOOConfig(), GenerationConfig()))
    assert RLOOConfig().ratio_level == "token" and token.loss_weight is not samples


def test_the_sequence_loss_refuses_another_mean():
    with pytest.raises(ValidationError, match="ratio_level"):
        RLOOConfig(ratio_level="sequence", loss_agg="seq_mean_token_mean")
    with pytest.raises(ValidationError, match="ratio_level"):
        RLOOConfig(ratio_level="sequence", dr_grpo=True)
