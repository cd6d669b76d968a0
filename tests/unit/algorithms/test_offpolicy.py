"""Decoupled PPO (``rayhf.algorithms.offpolicy``): the standard loss when the sampling and the
proximal policy agree, importance-weighted and capped when they do not (no Ray)."""

import torch
from algo_support import _mask

from rayhf.algorithms.grpo import GRPOConfig, grpo_loss
from rayhf.algorithms.offpolicy import behaviour_weights
from rayhf.algorithms.ppo import ppo_policy_loss

LENGTHS = [5, 0, 3, 7]


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    mask = _mask(LENGTHS, 7)
    shape = mask.shape
    new = (torch.randn(shape, generator=g) * 0.3 - 1.0).requires_grad_()
    old = torch.randn(shape, generator=g) * 0.3 - 1.0
    adv = torch.randn(shape, generator=g)
    return new, old, adv, mask


def test_the_decoupled_loss_equals_the_standard_one_when_the_versions_match():
    for seed in range(5):
        new, old, adv, mask = _case(seed)
        standard, s1 = ppo_policy_loss(new, old, adv, mask, 0.2)
        decoupled, s2 = ppo_policy_loss(new, old, adv, mask, 0.2, behaviour=old.clone())
        assert torch.equal(standard, decoupled)
        (g1,) = torch.autograd.grad(standard, new)
        (g2,) = torch.autograd.grad(decoupled, new)
        assert torch.equal(g1, g2)
        assert s2["is_weight_mean"] == 1.0 and s2["is_capped_frac"] == 0.0
        assert {k: s1[k] for k in s1} == {k: s2[k] for k in s1}
        cfg = GRPOConfig()
        seq_adv = adv[:, 0]
        ref = old - 0.1
        a, _ = grpo_loss(new, old, ref, seq_adv, mask, cfg)
        b, _ = grpo_loss(new, old, ref, seq_adv, mask, cfg, behaviour=old.clone())
        assert torch.equal(a, b)


def test_stale_samples_are_weighted_by_proximal_over_behaviour_and_capped():
    new, old, adv, mask = _case(7)
    behaviour = old - 0.5 * torch.rand(old.shape, generator=torch.Generator().manual_seed(3))
    behaviour[0, 0] = old[0, 0] - 3.0  # a token the old policy liked e^3 times more: capped
    loss, stats = ppo_policy_loss(new, old, adv, mask, 0.2, behaviour=behaviour, weight_cap=2.0)
    weights, _ = behaviour_weights(old, behaviour, mask, 2.0)
    expected = torch.exp(old - behaviour).clamp(max=2.0)
    assert torch.allclose(weights[mask], expected[mask])
    assert weights[0, 0] == 2.0 and stats["is_weight_max"] > 20 and stats["is_capped_frac"] > 0
    ratio = torch.exp(new - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * expected
    assert torch.allclose(loss, per_token[mask].mean())
    unweighted, _ = ppo_policy_loss(new, old, adv, mask, 0.2)
    assert not torch.allclose(loss, unweighted)
