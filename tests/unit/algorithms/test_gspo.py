"""GSPO's math (Zheng et al., 2025, the sequence-level objective) on hand-computed cases: the
length-normalized sequence ratio, its clip, the gradient every token of a sequence shares, the
behaviour weight per sequence, and the settings it refuses."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from rayhf.algorithms.gspo import GSPOConfig, gspo_loss, sequence_ratio

MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)


def test_the_ratio_is_the_geometric_mean_of_the_token_ratios():
    diff = torch.tensor([[0.2, -0.1, 0.5], [0.3, 0.1, 9.0], [-0.4, 9.0, 9.0], [9.0, 9.0, 9.0]])
    ratio = sequence_ratio(diff, torch.zeros_like(diff), MASK)  # padding (9.0) left out
    assert ratio.tolist() == pytest.approx([math.exp(0.2), math.exp(0.2), math.exp(-0.4), 1.0])


def test_the_sequence_surrogate_its_clip_and_the_shared_gradient():
    cfg = GSPOConfig(eps_low=0.1, eps_high=0.2)
    old = torch.zeros(4, 3)
    # log-ratios whose means are 0.1, 0.4 and -0.3: ratios 1.105 (inside), 1.49, 0.74
    logp = torch.tensor([[0.1, 0.1, 0.1], [0.5, 0.3, 0.0], [-0.3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    logp.requires_grad_(True)
    adv = torch.tensor([1.0, 2.0, -1.0, 5.0])  # the empty row's advantage counts for nothing
    loss, stats = gspo_loss(logp, old, old, adv, MASK, cfg)
    s = [math.exp(0.1), math.exp(0.4), math.exp(-0.3)]
    # row 1: A > 0, s above 1 + eps_high: the clipped -A * 1.2; row 2: A < 0, s below
    # 1 - eps_low: max(-A s, -A * 0.9) is the clipped 0.9. Clipped rows have no gradient.
    per_seq = [-1.0 * s[0], -2.0 * 1.2, max(1.0 * s[2], 1.0 * 0.9)]
    assert loss.item() == pytest.approx(sum(per_seq) / 3)
    assert stats["clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    # row 0 unclipped: every token's gradient is -A * s / (n tokens * 3 sequences)
    assert logp.grad[0].tolist() == pytest.approx([-s[0] / 9] * 3)
    assert logp.grad[1].abs().sum() == 0 and logp.grad[2].abs().sum() == 0  # clipped rows
    assert logp.grad[3].abs().sum() == 0  # the empty row


def test_a_stale_batch_weighs_each_sequence_by_its_own_behaviour_ratio():
    cfg = GSPOConfig(weight_cap=1.5, max_staleness=1)
    logp = torch.zeros(4, 3)
    behaviour = torch.tensor([[-0.3, -0.3, -0.3], [-3.0, -3.0, 0.0], [0.0] * 3, [0.0] * 3])
    adv = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss, stats = gspo_loss(logp, logp, logp, adv, MASK, cfg, behaviour)
    # weights exp(0.3) and exp(3.0) capped at 1.5, and 1; each ratio is 1, each surrogate -A
    assert loss.item() == pytest.approx(-(math.exp(0.3) + 1.5 + 1.0) / 3)
    # the stats count tokens: each sequence's weight on each of its tokens
    mean = (3 * math.exp(0.3) + 2 * math.exp(3.0) + 1) / 6
    assert stats["is_weight_mean"] == pytest.approx(mean, rel=1e-6)


def test_settings_gspo_refuses():
    with pytest.raises(ValidationError, match="dr_grpo"):
        GSPOConfig(dr_grpo=True)
    with pytest.raises(ValidationError, match="eps_low"):
        GSPOConfig(eps_low=1.0)
    assert GSPOConfig().eps_low == 3e-4 and GSPOConfig().eps_high == 4e-4  # the paper's
