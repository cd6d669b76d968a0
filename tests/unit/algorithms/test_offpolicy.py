"""Decoupled PPO (``rayhf.algorithms.offpolicy``): the standard loss when the sampling and the
proximal policy agree, importance-weighted and capped when they do not (no Ray)."""

from typing import Any, cast

import pytest
import torch
from algo_support import ScoresFromForward, _mask

from rayhf.algorithms.grpo import GRPOConfig, grpo_loss
from rayhf.algorithms.interface import VERSION_EXTRA
from rayhf.algorithms.lm import response_forward
from rayhf.algorithms.offpolicy import (
    OffPolicyConfig,
    PolicyReference,
    behaviour_weights,
    policy_train_shape,
)
from rayhf.algorithms.ppo import ppo_policy_loss
from rayhf.data.batch import PackedBatch

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
        stale = OffPolicyConfig(max_staleness=1)
        decoupled, s2 = ppo_policy_loss(new, old, adv, mask, 0.2, old.clone(), stale)
        assert torch.equal(standard, decoupled)
        (g1,) = torch.autograd.grad(standard, new)
        (g2,) = torch.autograd.grad(decoupled, new)
        assert torch.equal(g1, g2)
        assert s2["is_weight_mean"] == 1.0 and s2["is_capped_frac"] == 0.0
        assert {k: s1[k] for k in s1} == {k: s2[k] for k in s1}
        cfg = GRPOConfig(max_staleness=1)
        seq_adv = adv[:, 0]
        ref = old - 0.1
        a, _ = grpo_loss(new, old, ref, seq_adv, mask, cfg)
        b, _ = grpo_loss(new, old, ref, seq_adv, mask, cfg, behaviour=old.clone())
        assert torch.equal(a, b)


def test_stale_samples_are_weighted_by_proximal_over_behaviour_and_capped():
    new, old, adv, mask = _case(7)
    behaviour = old - 0.5 * torch.rand(old.shape, generator=torch.Generator().manual_seed(3))
    behaviour[0, 0] = old[0, 0] - 3.0  # a token the old policy liked e^3 times more: capped
    cfg = OffPolicyConfig(max_staleness=1, weight_cap=2.0)
    loss, stats = ppo_policy_loss(new, old, adv, mask, 0.2, behaviour=behaviour, cfg=cfg)
    weights, _ = behaviour_weights(old, behaviour, mask, cfg)
    expected = torch.exp(old - behaviour).clamp(max=2.0)
    assert torch.allclose(weights[mask], expected[mask])
    assert weights[0, 0] == 2.0 and stats["is_weight_max"] > 20 and stats["is_capped_frac"] > 0
    ratio = torch.exp(new - old)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)) * expected
    assert torch.allclose(loss, per_token[mask].mean())
    unweighted, _ = ppo_policy_loss(new, old, adv, mask, 0.2)
    assert not torch.allclose(loss, unweighted)


class _Bigram(ScoresFromForward):
    """A bigram model (logits at a position = ``table[its token]``) that counts the rows it
    forwards; the test changes ``table`` between minibatches as an update would."""

    pad_id = 0

    def __init__(self, seed: int) -> None:
        self.table = torch.randn(9, 9, generator=torch.Generator().manual_seed(seed))
        self.rows = 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        self.rows += input_ids.shape[0]
        return self.table[input_ids]

    def micro_batches(self, batch: PackedBatch) -> list[PackedBatch]:
        return [batch]


def _rollouts(n: int) -> PackedBatch:
    """Prompt [2] + a response of 1-3 tokens per sample, with the generator's log-probs."""
    g = torch.Generator().manual_seed(n)
    batch = PackedBatch(list(range(n)))
    seqs = [[2, *torch.randint(3, 9, (1 + i % 3,), generator=g).tolist()] for i in range(n)]
    batch.add("seq", torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
    batch.add("prompt_lens", torch.ones(n, dtype=torch.long), [1] * n)
    behaviour = [torch.randn(len(s) - 1, generator=g) - 2.0 for s in seqs]
    batch.add("logprobs", torch.cat(behaviour), [len(s) - 1 for s in seqs])
    return batch


def _go_over(epochs: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor | None]], dict, int]:
    """One epoch of a stale train call over 3 minibatches, the weights changing after each:
    each minibatch's (old, behaviour) log-probs, the mismatch and the rows forwarded. The old
    ones must be the first weights' (``_before``)."""
    engine, batch = _Bigram(5), _rollouts(9)
    cfg = OffPolicyConfig(max_staleness=1)
    reference = PolicyReference(cast(Any, engine), batch, 1.0, cfg, epochs)
    minibatches = batch.split(3, "seq")
    reference.start_epoch(0, minibatches)
    seen = []
    for mb in minibatches:
        logp, _, mask = response_forward(cast(Any, engine), mb)
        seen.append(reference.old(mb, logp, mask))
        assert torch.allclose(seen[-1][0], _before(mb)), "proximal: the first weights' log-probs"
        engine.table = engine.table + 0.3 * torch.randn(9, 9)  # the update after each minibatch
    return seen, reference.stats(cast(Any, _Sum())), engine.rows


def _before(mb: PackedBatch) -> torch.Tensor:
    logp, _, mask = response_forward(cast(Any, _Bigram(5)), mb)
    return torch.where(mask, logp, torch.zeros_like(logp))


class _Sum:
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        return t


def test_with_one_epoch_the_first_minibatch_s_forward_gives_its_proximal_log_probs():
    free, free_stats, free_rows = _go_over(epochs=1)
    upfront, upfront_stats, upfront_rows = _go_over(epochs=2)  # every proximal one first
    for (old_a, behaviour_a), (old_b, behaviour_b) in zip(free, upfront, strict=True):
        assert torch.allclose(old_a, old_b) and behaviour_a is not None
        assert behaviour_b is not None and torch.equal(behaviour_a, behaviour_b)
    assert free_stats["logprob_mismatch"] == pytest.approx(upfront_stats["logprob_mismatch"])
    # the train forwards 9 rows either way; the proximal pass 6 (minibatches 2, 3) instead of 9
    assert (free_rows, upfront_rows) == (9 + 6, 9 + 9)


def test_interpolated_proximal_log_probs_cost_no_forward_and_are_exact_where_they_can_be():
    engine, batch = _Bigram(5), _rollouts(9)
    batch.add_extra(VERSION_EXTRA, [1] * 6 + [2] * 3)  # step 3: 1 step stale, then fresh
    cfg = OffPolicyConfig(max_staleness=1, proximal="interpolate")
    assert policy_train_shape(cfg, 1, 3).forward_share == 0.0
    reference = PolicyReference(cast(Any, engine), batch, 1.0, cfg, 1, step=3)
    minibatches = batch.split(3, "seq")
    reference.start_epoch(0, minibatches)
    first_gap = []
    for j, mb in enumerate(minibatches):
        logp, _, mask = response_forward(cast(Any, engine), mb)
        old, behaviour = reference.old(mb, logp, mask)
        assert behaviour is not None
        for row, sample in enumerate(mb.sample_ids):
            m = mask[row]
            if j == 0:  # before any update: the trainer's own, the proximal ones exactly
                assert torch.equal(old[row][m], logp[row][m].detach())
                first_gap.append((behaviour[row][m] - logp[row][m]).abs())
            elif sample >= 6:  # sampled by the proximal weights themselves
                assert torch.equal(old[row][m], behaviour[row][m])
            else:  # 1 step (3 updates) stale, j updates in: 3 / (3 + j) of the way to current
                a = 3 / (3 + j)
                expected = behaviour[row][m] + a * (logp[row][m].detach() - behaviour[row][m])
                assert torch.allclose(old[row][m], expected)
            assert not old.requires_grad
        engine.table = engine.table + 0.3 * torch.randn(9, 9)
    assert engine.rows == 9  # the train forwards only: no proximal pass
    gap = torch.cat(first_gap)
    stats = reference.stats(cast(Any, _Sum()))
    assert stats["logprob_mismatch"] == pytest.approx(gap.mean().item())
    del batch.extras[VERSION_EXTRA]
    with pytest.raises(RuntimeError, match=VERSION_EXTRA):
        PolicyReference(cast(Any, engine), batch, 1.0, cfg, 1, step=3)


# ----- rollout correction ----------------------------------------------------------------------

# rho per token: e^1, e^-1, 1 | e^0.5, (pad), (pad); row products e^0 and e^0.5
_OLD = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
_GEN = torch.tensor([[-1.0, 1.0, 0.0], [-0.5, 0.0, 0.0]])
_M = _mask([3, 1], 3)
E = torch.e


def _weights(**cfg) -> tuple[list[float], dict[str, float]]:
    """The weights, flat, and their stats."""
    w, stats = behaviour_weights(_OLD, _GEN, _M, OffPolicyConfig(**cfg))
    return w.flatten().tolist(), stats


def test_truncated_importance_sampling_per_token_and_per_sequence() -> None:
    w, stats = _weights(correction="tis", weight_cap=2.0)
    assert w == pytest.approx([2.0, 1 / E, 1.0, E**0.5, 1.0, 1.0])
    assert stats["is_capped_frac"] == pytest.approx(1 / 4) and stats["is_masked_frac"] == 0
    assert stats["is_weight_max"] == pytest.approx(E) and stats["is_weight_std"] > 0
    w, _ = _weights(correction="tis", correction_level="sequence")
    assert w == pytest.approx([1.0, 1.0, 1.0, E**0.5, 1.0, 1.0])


def test_masked_importance_sampling_token_sequence_and_geometric() -> None:
    # token: e (above 2) and 1/e (below 1/2) masked, the others keep rho
    w, stats = _weights(correction="mis", weight_cap=2.0)
    assert w == pytest.approx([0.0, 0.0, 1.0, E**0.5, 1.0, 1.0])
    assert stats["is_masked_frac"] == pytest.approx(2 / 4)
    # sequence: products 1 and e^0.5 < 2 kept; with a cap of 1.5 the second row goes
    w, _ = _weights(correction="mis", correction_level="sequence", weight_cap=1.5)
    assert w == pytest.approx([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
    # geometric: row 0's mean log-ratio 0, row 1's 0.5 (one token): a tight band drops row 1
    w, _ = _weights(correction="mis", correction_level="geometric", weight_cap=1.001)
    assert w == pytest.approx([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])


def test_icepop_masks_outside_half_to_five_unless_told_otherwise() -> None:
    w, _ = _weights(correction="icepop")  # e is inside [0.5, 5], 1/e = 0.37 is not
    assert w == pytest.approx([E, 0.0, 1.0, E**0.5, 1.0, 1.0])
    assert OffPolicyConfig(correction="icepop").correction_bounds() == (0.5, 5.0)
    assert OffPolicyConfig(correction="icepop", weight_cap=3.0).correction_bounds() == (0.5, 3.0)
    # a saved config (every field written) reads the same bounds back
    saved = OffPolicyConfig(correction="icepop")
    assert OffPolicyConfig.model_validate(saved.model_dump()).correction_bounds() == (0.5, 5.0)


def test_settings_a_correction_refuses() -> None:
    with pytest.raises(ValueError, match="weight_floor 3 is not below weight_cap 2"):
        OffPolicyConfig(correction="mis", weight_floor=3.0)
    with pytest.raises(ValueError, match="old_logprobs: with max_staleness > 0"):
        OffPolicyConfig(max_staleness=1, old_logprobs="recompute")


def test_the_decoupled_cap_clamps_or_masks_as_asked() -> None:
    """Off-policy, decoupled PPO truncates its weight at the cap (``auto``: tis); AReaL masks
    a token above it (``mis``): rho = e there weighs 2 against 0."""
    clamp, _ = _weights(max_staleness=1)
    mask, _ = _weights(max_staleness=1, correction="mis", weight_floor=0.0)
    assert clamp[0] == 2.0 and mask[0] == 0.0 and mask[1] == pytest.approx(1 / E)


def test_a_correction_on_policy_recomputes_the_old_log_probs() -> None:
    assert not OffPolicyConfig().recomputes  # the generator's (bypass)
    assert OffPolicyConfig(correction="tis").recomputes
    assert OffPolicyConfig(old_logprobs="recompute").recomputes
    assert not OffPolicyConfig(old_logprobs="recompute").corrects
    with pytest.raises(ValueError, match="old_logprobs: recompute"):
        OffPolicyConfig(correction="mis", old_logprobs="generator")
    shape = policy_train_shape(OffPolicyConfig(correction="icepop"), 1, 4)
    assert shape.forward_share == 0.75  # every minibatch but the first forwards first
    # the reference hands back the trainer's own log-probs and the generator's
    engine, batch = _Bigram(5), _rollouts(6)
    reference = PolicyReference(cast(Any, engine), batch, 1.0, OffPolicyConfig(correction="tis"), 1)
    minibatches = batch.split(2, "seq")
    reference.start_epoch(0, minibatches)
    logp, _, mask = response_forward(cast(Any, engine), minibatches[1])
    old, behaviour = reference.old(minibatches[1], logp, mask)
    assert behaviour is not None and torch.allclose(old, _before(minibatches[1]))
    assert not torch.allclose(old[mask], behaviour[mask])
