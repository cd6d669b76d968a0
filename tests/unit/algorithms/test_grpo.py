"""GRPO, ReMax, DPO, reward-model and SFT losses, against hand-worked numbers and slow loops.

Random cases use rows of varied length, including an empty row, with garbage on the padding so
that any leak of padded values into a result shows up.
"""

import math
import statistics

import pydantic
import pytest
import torch
import torch.nn.functional as F

from rayhf.algorithms.dpo import DPOConfig, dpo_loss, sequence_logprob
from rayhf.algorithms.grpo import (
    GRPOConfig,
    group_advantages,
    grpo_advantages,
    grpo_loss,
    k3_kl,
)
from rayhf.algorithms.remax import ReMaxConfig, reinforce_loss, remax_advantages
from rayhf.algorithms.rm import bradley_terry_loss, final_token_scores
from rayhf.algorithms.sft import sft_loss
from rayhf.errors import RayhfError

LENGTHS = [0, 1, 7, 3, 5]
T = 7
GARBAGE = 1234.5
LN = math.log


def _mask(lengths: list[int], t: int = T) -> torch.Tensor:
    return torch.arange(t).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)


def _rand(seed: int, lengths: list[int] = LENGTHS, scale: float = 1.0) -> torch.Tensor:
    """Random float64 [B, T] with GARBAGE on padding."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), T, generator=g, dtype=torch.float64) * scale
    return torch.where(_mask(lengths), x, torch.full_like(x, GARBAGE))


def _vec(seed: int, n: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g, dtype=torch.float64) * scale


def _valid(x: torch.Tensor, lengths: list[int] = LENGTHS) -> list[list[float]]:
    """Per row, the valid entries as Python floats."""
    return [row[:n] for row, n in zip(x.tolist(), lengths, strict=True)]


def _pad(rows: list[list[float]], t: int = T) -> list[list[float]]:
    return [row + [0.0] * (t - len(row)) for row in rows]


def _close(a: torch.Tensor | None, b, tol: float = 1e-9) -> None:
    assert a is not None  # e.g. a .grad that was never filled
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), rtol=tol, atol=tol)


def _softplus(z: float) -> float:
    """-logsigmoid(-z) = log(1 + e^z), the reference for every logistic loss below."""
    return math.log1p(math.exp(z))


# ----- configs ------------------------------------------------------------------------------


def test_config_defaults() -> None:
    g = GRPOConfig()
    assert (g.group_size, g.kl_coef, g.eps_clip, g.eps) == (4, 0.04, 0.2, 1e-6)
    assert (g.dr_grpo, g.max_new_tokens_norm, g.n_minibatches, g.ppo_epochs) == (False, None, 4, 1)
    r = ReMaxConfig()
    assert (r.kl_ctl, r.reward_clip, r.n_minibatches, r.adv_norm) == (0.1, 20.0, 1, False)
    d = DPOConfig()
    assert (d.beta, d.label_smoothing, d.n_minibatches) == (0.1, 0.0, 1)
    for cls in (GRPOConfig, ReMaxConfig, DPOConfig):
        assert all(f.description for f in cls.model_fields.values()), cls  # attribute docstrings


@pytest.mark.parametrize(
    "cls,bad",
    [
        (GRPOConfig, {"group_size": 1}),
        (GRPOConfig, {"kl_coef": -0.1}),
        (GRPOConfig, {"eps_clip": 0.0}),
        (GRPOConfig, {"eps": 0.0}),
        (GRPOConfig, {"max_new_tokens_norm": 0}),
        (GRPOConfig, {"n_minibatches": 0}),
        (GRPOConfig, {"ppo_epochs": 0}),
        (GRPOConfig, {"no_such_field": 1}),
        (ReMaxConfig, {"kl_ctl": -1.0}),
        (ReMaxConfig, {"reward_clip": 0.0}),
        (ReMaxConfig, {"n_minibatches": 0}),
        (DPOConfig, {"beta": 0.0}),
        (DPOConfig, {"label_smoothing": 0.5}),
        (DPOConfig, {"label_smoothing": -0.1}),
        (DPOConfig, {"n_minibatches": 0}),
    ],
)
def test_config_rejects_bad_values(cls: type[pydantic.BaseModel], bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        cls(**bad)


# ----- GRPO advantages ----------------------------------------------------------------------


def test_group_advantages_by_hand() -> None:
    # groups by id, not contiguous: 10 -> positions 0, 2, 5; 3 -> 1, 4; 7 -> 3 (size 1)
    scores = torch.tensor([1.0, 2.0, 3.0, 9.0, 6.0, 5.0], dtype=torch.float64)
    ids = torch.tensor([10, 3, 10, 7, 3, 10])
    # id 10: 1, 3, 5 -> mean 3, sample std sqrt((4 + 0 + 4) / 2) = 2 -> -1, 0, 1
    #        (the population std sqrt(8/3) would give ±1.22)
    # id 3:  2, 6 -> mean 4, sample std sqrt(8 / 1) = 2 sqrt 2 -> ∓1/sqrt 2
    # id 7:  a group of one -> 0, even with eps = 0 where its std would give 0 / 0
    h = 1 / math.sqrt(2.0)
    _close(group_advantages(scores, ids, eps=0.0), [-1.0, -h, 0.0, 0.0, h, 1.0])
    got = group_advantages(scores, ids, eps=1e-6)
    _close(got[[0, 5]], [-2 / (2 + 1e-6), 2 / (2 + 1e-6)])
    _close(group_advantages(scores, ids, eps=0.0, scale=False), [-2.0, -2.0, 0.0, 0.0, 2.0, 2.0])
    ints = group_advantages(torch.tensor([1, 3, 5]), torch.tensor([0, 0, 0]), eps=0.0)
    _close(ints, [-1.0, 0.0, 1.0], 1e-6)  # integer scores work too


def test_group_advantages_matches_reference() -> None:
    ids = [4, 1, 4, 2, 0, 1, 4, 0, 3, 1, 0, 4, 1]  # sizes 4, 4, 1, 3, 1, interleaved
    scores = _vec(20, len(ids), scale=3.0)
    eps = 1e-3
    for scale in (True, False):
        got = group_advantages(scores, torch.tensor(ids), eps, scale)
        expected = []
        for i, s in enumerate(scores.tolist()):
            group = [v for v, j in zip(scores.tolist(), ids, strict=True) if j == ids[i]]
            if len(group) == 1:
                expected.append(0.0)
                continue
            centered = s - statistics.mean(group)
            expected.append(centered / (statistics.stdev(group) + eps) if scale else centered)
        _close(got, expected)


def test_group_advantages_equal_scores_and_empty() -> None:
    out = group_advantages(torch.full((4,), 0.7), torch.tensor([0, 0, 1, 1]), eps=1e-6)
    assert torch.equal(out, torch.zeros(4))
    empty = group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), eps=1e-6)
    assert empty.shape == (0,)


def test_grpo_advantages_follow_config() -> None:
    scores, ids = torch.tensor([0.0, 4.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    # sample std of (0, 4) is 2 sqrt 2
    _close(grpo_advantages(scores, ids, GRPOConfig(eps=1e-9))[:2], [-1 / 2**0.5, 1 / 2**0.5], 1e-6)
    _close(grpo_advantages(scores, ids, GRPOConfig(dr_grpo=True)), [-2.0, 2.0, 0.0, 0.0])


# ----- k3 KL --------------------------------------------------------------------------------


def test_k3_by_hand() -> None:
    # d = ref - logp: ln 2 -> 2 - ln 2 - 1; -ln 2 -> 1/2 + ln 2 - 1; 0 -> 0; padding -> 0
    logp = torch.tensor([[0.0, 0.0, 0.0], [0.0, 5.0, 5.0]], requires_grad=True)
    ref = torch.tensor([[LN(2), -LN(2), 0.0], [0.0, -50.0, 90.0]])
    kl = k3_kl(logp, ref, _mask([3, 1], 3))
    _close(kl.detach(), [[1 - LN(2), LN(2) - 0.5, 0.0], [0.0, 0.0, 0.0]], 1e-6)
    kl.sum().backward()
    _close(logp.grad, [[-1.0, 0.5, 0.0], [0.0, 0.0, 0.0]], 1e-6)  # d/dlogp = 1 - e^d


def test_k3_matches_reference_and_is_nonnegative() -> None:
    logp, ref = _rand(21), _rand(22)
    kl = k3_kl(logp, ref, _mask(LENGTHS))
    expected = [
        [math.exp(r - p) - (r - p) - 1 for p, r in zip(lp, rp, strict=True)]
        for lp, rp in zip(_valid(logp), _valid(ref), strict=True)
    ]
    _close(kl, _pad(expected))
    g = torch.Generator().manual_seed(23)
    near = torch.randn(64, 512, generator=g) * torch.logspace(-9, 0, 512)  # float32, d near 0
    base = torch.randn(64, 512, generator=g)
    mask = torch.ones(64, 512, dtype=torch.bool)
    assert (k3_kl(base, base + near, mask) >= 0).all()
    assert torch.equal(k3_kl(base, base, mask), torch.zeros(64, 512))


# ----- GRPO loss ----------------------------------------------------------------------------


def _clip_case() -> tuple[torch.Tensor, ...]:
    new = torch.tensor([[LN(1.5), LN(0.5)], [LN(1.5), LN(0.5)], [0.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, -50.0]])
    return new, old, torch.tensor([1.0, -1.0, 2.0]), _mask([2, 2, 1], 2)


def test_grpo_loss_clip_cases_by_hand() -> None:
    # eps 0.2, advantage per row. Tokens (A, ratio) -> max(-A r, -A clip(r)):
    #   row 0, A = +1: r 1.5 -> -1.2 clipped, r 0.5 -> -0.5
    #   row 1, A = -1: r 1.5 -> 1.5,          r 0.5 -> 0.8 clipped
    #   row 2, A = +2: r 1 -> -2
    # sum -1.4 over 5 tokens: token-mean -0.28, clip_frac 2/5; ref = new, so k3 adds 0
    new, old, adv, mask = _clip_case()
    loss, stats = grpo_loss(new, old, new.detach(), adv, mask, GRPOConfig())
    _close(loss.detach(), -0.28, 1e-6)
    assert stats["clip_frac"] == pytest.approx(0.4)
    assert stats["approx_kl"] == pytest.approx(-2 * LN(0.75) / 5)  # mean(old - new)
    assert stats["kl"] == pytest.approx(0.0, abs=1e-7)
    loss.backward()
    # clipped tokens get no gradient; others d(-A r)/d logp / 5 = -A r / 5
    _close(new.grad, [[0.0, -0.1], [0.3, 0.0], [-0.4, 0.0]], 1e-6)


def test_dr_grpo_clip_cases_by_hand() -> None:
    # same tokens, Dr. GRPO: sum -1.4 / (B * longest) = -1.4 / (3 * 2); with norm 4: / 12
    new, old, adv, mask = _clip_case()
    loss, _ = grpo_loss(new, old, new.detach(), adv, mask, GRPOConfig(dr_grpo=True))
    _close(loss.detach(), -1.4 / 6, 1e-6)
    loss.backward()
    _close(new.grad, [[0.0, -0.5 / 6], [1.5 / 6, 0.0], [-2 / 6, 0.0]], 1e-6)
    cfg = GRPOConfig(dr_grpo=True, max_new_tokens_norm=4)
    _close(grpo_loss(new, old, new, adv, mask, cfg)[0].detach(), -1.4 / 12, 1e-6)
    with pytest.raises(RayhfError, match="max_new_tokens_norm"):
        grpo_loss(new, old, new, adv, mask, GRPOConfig(dr_grpo=True, max_new_tokens_norm=1))


def test_grpo_loss_kl_term_by_hand() -> None:
    # ratio 1 and A = 0, so only kl_coef * k3 remains: k3 = 1 - ln 2, ln 2 - 1/2, 0 (see above)
    # loss = 0.5 * (1/2) / 3 = 1/12, kl stat 1/6; grad 0.5 * (1 - e^d) / 3
    logp = torch.zeros(2, 3, requires_grad=True)
    ref = torch.tensor([[LN(2), -LN(2), 0.0], [7.0, 7.0, 7.0]])
    cfg = GRPOConfig(kl_coef=0.5)
    loss, stats = grpo_loss(logp, logp.detach(), ref, torch.zeros(2), _mask([3, 0], 3), cfg)
    _close(loss.detach(), 1 / 12, 1e-6)
    assert stats["kl"] == pytest.approx(1 / 6)
    loss.backward()
    _close(logp.grad, [[-1 / 6, 1 / 12, 0.0], [0.0, 0.0, 0.0]], 1e-6)


def test_token_mean_and_dr_grpo_weigh_tokens_differently() -> None:
    # ratio 1, A = 1, no KL: the gradient of a token is minus its weight in the aggregate.
    # Token-mean: 1 / (valid tokens in the batch), so row 0's token weighs 1/5 next to a
    # 4-token row but 1/2 next to a 1-token row, and the 4-token row as a whole weighs 4x more.
    # Dr. GRPO: 1 / (B * norm) whatever the other rows hold; None -> longest valid row, not T.
    def weights(lengths: list[int], cfg: GRPOConfig) -> torch.Tensor:
        logp = torch.zeros(3, 6, requires_grad=True)
        const = logp.detach()
        loss, _ = grpo_loss(logp, const, const, torch.ones(3), _mask(lengths, 6), cfg)
        loss.backward()
        assert logp.grad is not None
        return -logp.grad

    mean_cfg, dr_cfg = GRPOConfig(kl_coef=0.0), GRPOConfig(kl_coef=0.0, dr_grpo=True)
    fixed_cfg = GRPOConfig(kl_coef=0.0, dr_grpo=True, max_new_tokens_norm=8)
    w = weights([1, 4, 0], mean_cfg)
    _close(w[0, 0], 0.2)
    _close(w.sum(dim=1), [0.2, 0.8, 0.0])
    _close(weights([1, 1, 0], mean_cfg)[0, 0], 0.5)
    _close(weights([1, 4, 0], dr_cfg)[:2, :4], [[1 / 12, 0, 0, 0], [1 / 12] * 4])
    _close(weights([1, 4, 0], fixed_cfg)[0, 0], 1 / 24)
    _close(weights([1, 1, 0], fixed_cfg)[0, 0], 1 / 24)


@pytest.mark.parametrize("dr_grpo,norm", [(False, None), (True, None), (True, 10)])
def test_grpo_loss_matches_reference(dr_grpo: bool, norm: int | None) -> None:
    new, old, ref = _rand(24, scale=0.5), _rand(25, scale=0.5), _rand(26, scale=0.5)
    adv = _vec(27, len(LENGTHS))
    cfg = GRPOConfig(eps_clip=0.1, kl_coef=0.3, dr_grpo=dr_grpo, max_new_tokens_norm=norm)
    loss, stats = grpo_loss(new, old, ref, adv, _mask(LENGTHS), cfg)
    losses, clipped, k3s, kls = [], [], [], []
    rows = zip(_valid(new), _valid(old), _valid(ref), adv.tolist(), strict=True)
    for n_row, o_row, r_row, a in rows:
        for n, o, r in zip(n_row, o_row, r_row, strict=True):
            ratio = math.exp(n - o)
            l1, l2 = -a * ratio, -a * max(0.9, min(1.1, ratio))
            k3 = math.exp(r - n) - (r - n) - 1
            losses.append(max(l1, l2) + 0.3 * k3)
            clipped.append(float(l2 > l1))
            k3s.append(k3)
            kls.append(o - n)
    divisor = len(LENGTHS) * (norm or max(LENGTHS)) if dr_grpo else len(losses)
    _close(loss, sum(losses) / divisor)
    assert 0 < stats["clip_frac"] < 1, "random case should exercise both branches"
    assert stats["clip_frac"] == pytest.approx(sum(clipped) / len(clipped))
    assert stats["kl"] == pytest.approx(sum(k3s) / len(k3s))
    assert stats["approx_kl"] == pytest.approx(sum(kls) / len(kls))


@pytest.mark.parametrize("dr_grpo", [False, True])
def test_grpo_loss_with_no_valid_tokens_is_zero_and_finite(dr_grpo: bool) -> None:
    mask = torch.zeros(2, 3, dtype=torch.bool)
    new = torch.full((2, 3), -float("inf"), requires_grad=True)
    cfg = GRPOConfig(dr_grpo=dr_grpo)
    loss, stats = grpo_loss(new, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), mask, cfg)
    loss.backward()
    assert loss.item() == 0.0 and all(v == 0.0 for v in stats.values())
    assert new.grad is not None and torch.isfinite(new.grad).all()


# ----- ReMax --------------------------------------------------------------------------------


def test_remax_advantages_by_hand() -> None:
    mask = _mask([3, 1, 2, 0], 3)
    sampled = torch.tensor([30.0, -1.0, 1.0, 5.0])
    greedy = torch.tensor([10.0, -25.0, 3.0, 0.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 9.0, 9.0], [-1.0, -1.0, 9.0], [9.0] * 3])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [0.0] * 3])
    adv = remax_advantages(sampled, greedy, logp, ref, mask, kl_ctl=0.1, reward_clip=20.0)
    # row 0: kl 0.5, 0, -1 -> rewards -0.05, 0, 0.1 + (clip 30 - 10 = 10); return-to-go
    #        10.05, 10.1, 10.1 (clipping the difference 20 instead would give 20)
    # row 1: -0.05 + (-1 - clip(-25) = -1 + 20 = 19) = 18.95
    # row 2: no KL, 1 - 3 = -2 at the last token -> -2, -2; row 3 is empty
    expected = [[10.05, 10.1, 10.1], [18.95, 0.0, 0.0], [-2.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
    _close(adv, expected, 1e-6)


def test_remax_advantage_sign_follows_greedy_baseline() -> None:
    logp, ref, mask = _rand(30), _rand(31), _mask(LENGTHS)
    better = remax_advantages(_vec(32, 5) + 1.0, _vec(32, 5), logp, ref, mask, 0.0, 20.0)
    assert (better[mask] > 0).all() and (better[~mask] == 0).all()
    _close(better[mask], torch.ones(sum(LENGTHS)))
    worse = remax_advantages(_vec(32, 5) - 1.0, _vec(32, 5), logp, ref, mask, 0.0, 20.0)
    assert (worse[mask] < 0).all()
    same = remax_advantages(_vec(32, 5), _vec(32, 5), logp, ref, mask, 0.0, 20.0)
    assert torch.equal(same, torch.zeros_like(same))


def test_remax_advantages_match_reference() -> None:
    logp, ref = _rand(33), _rand(34)
    sampled = torch.tensor([50.0, -3.0, -40.0, 0.5, 19.0], dtype=torch.float64)
    greedy = torch.tensor([1.0, 30.0, -2.0, 0.7, -25.0], dtype=torch.float64)
    kl_ctl, clip = 0.05, 10.0
    adv = remax_advantages(sampled, greedy, logp, ref, _mask(LENGTHS), kl_ctl, clip)
    clamp = lambda v: max(-clip, min(clip, v))  # noqa: E731
    expected = []
    for lp, rp, s, g in zip(
        _valid(logp), _valid(ref), sampled.tolist(), greedy.tolist(), strict=True
    ):
        rewards = [-kl_ctl * (a - b) for a, b in zip(lp, rp, strict=True)]
        if rewards:
            rewards[-1] += clamp(s) - clamp(g)
        expected.append([sum(rewards[t:]) for t in range(len(rewards))])
    _close(adv, _pad(expected))


def test_reinforce_loss_by_hand() -> None:
    # loss = -(2 * -1 + 1 * -2 + -1 * -0.5) / 3 = 3.5 / 3; d/dlogp = -A / 3
    logp = torch.tensor([[-1.0, -2.0, 99.0], [-0.5, -math.inf, 0.0], [1.0] * 3], requires_grad=True)
    adv = torch.tensor([[2.0, 1.0, 5.0], [-1.0, 7.0, 7.0], [3.0] * 3], requires_grad=True)
    loss, stats = reinforce_loss(logp, adv, _mask([2, 1, 0], 3))
    _close(loss.detach(), 3.5 / 3, 1e-6)
    assert stats["advantage_mean"] == pytest.approx(2 / 3)
    loss.backward()
    _close(logp.grad, [[-2 / 3, -1 / 3, 0.0], [1 / 3, 0.0, 0.0], [0.0] * 3], 1e-6)
    assert adv.grad is None  # advantages are constants of the gradient


def test_reinforce_loss_matches_reference() -> None:
    logp, adv = _rand(35), _rand(36)
    loss, stats = reinforce_loss(logp, adv, _mask(LENGTHS))
    pairs = [
        (a, p)
        for lp, ap in zip(_valid(logp), _valid(adv), strict=True)
        for p, a in zip(lp, ap, strict=True)
    ]
    _close(loss, -sum(a * p for a, p in pairs) / len(pairs))
    assert stats["advantage_mean"] == pytest.approx(sum(a for a, _ in pairs) / len(pairs))
    empty, _ = reinforce_loss(logp, adv, torch.zeros_like(_mask(LENGTHS)))
    assert empty.item() == 0.0


# ----- DPO ----------------------------------------------------------------------------------


def test_sequence_logprob_by_hand_and_reference() -> None:
    x = torch.tensor([[-1.0, -2.0, 50.0], [-0.5, 50.0, 50.0], [50.0] * 3])
    _close(sequence_logprob(x, _mask([2, 1, 0], 3)), [-3.0, -0.5, 0.0])
    logp = _rand(40)
    _close(sequence_logprob(logp, _mask(LENGTHS)), [sum(row) for row in _valid(logp)])


@pytest.mark.parametrize("ls", [0.0, 0.2, 0.45])
def test_dpo_loss_at_zero_margin_is_log_2(ls: float) -> None:
    # both logsigmoid terms are log(1/2), weighted (1 - ls) + ls = 1
    pi_c, pi_r = torch.tensor([-3.0, -7.0]), torch.tensor([-1.0, -2.0])
    ref_c, ref_r = pi_c + 0.5, pi_r + 0.5  # equal log-ratios, so margin 0
    loss, stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.3, label_smoothing=ls)
    _close(loss, math.log(2.0), 1e-6)
    assert stats["reward_accuracy"] == 0.0  # a tie is not a win
    assert stats["reward_margin"] == pytest.approx(0.0, abs=1e-7)


def test_dpo_loss_by_hand_and_gradient_sign() -> None:
    # beta 0.5. pair 0: chosen log-ratio +2, rejected -2 -> margin 4, beta m = 2
    #           pair 1: chosen 0, rejected +1            -> margin -1, beta m = -0.5
    # loss = (log(1 + e^-2) + log(1 + e^0.5)) / 2
    pi_c = torch.tensor([-3.0, -4.0], requires_grad=True)
    pi_r = torch.tensor([-6.0, -1.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-5.0, -4.0]), torch.tensor([-4.0, -2.0])
    loss, stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5)
    _close(loss.detach(), (_softplus(-2.0) + _softplus(0.5)) / 2, 1e-6)
    assert stats["reward_margin"] == pytest.approx(0.75)  # (2 - 0.5) / 2
    assert stats["reward_accuracy"] == pytest.approx(0.5)
    assert stats["chosen_reward"] == pytest.approx(0.5)  # 0.5 * (2 + 0) / 2
    assert stats["rejected_reward"] == pytest.approx(-0.25)  # 0.5 * (-2 + 1) / 2
    loss.backward()
    # dL/d pi_c = -beta sigmoid(-beta m) / B: descent raises chosen, lowers rejected
    sig = torch.sigmoid(torch.tensor([-2.0, 0.5]))
    assert pi_c.grad is not None and pi_r.grad is not None
    _close(pi_c.grad, -0.25 * sig, 1e-6)
    _close(pi_r.grad, 0.25 * sig, 1e-6)
    assert bool((pi_c.grad < 0).all()) and bool((pi_r.grad > 0).all())


def test_dpo_label_smoothing() -> None:
    # ls 0.1 at beta m = 2: 0.9 log(1 + e^-2) + 0.1 log(1 + e^2)
    zero = torch.zeros(1)
    loss, _ = dpo_loss(torch.tensor([4.0]), zero, zero, zero, beta=0.5, label_smoothing=0.1)
    _close(loss, 0.9 * _softplus(-2.0) + 0.1 * _softplus(2.0), 1e-6)
    # dL/dz = -(1 - ls) sigmoid(-z) + ls sigmoid(z) is 0 at e^z = (1 - ls) / ls: the loss stops
    # pushing there, and past it pushes the chosen response back down
    for z, sign in [(math.log(9.0), 0), (math.log(9.0) + 1, 1), (math.log(9.0) - 1, -1)]:
        pi_c = torch.tensor([z], dtype=torch.float64, requires_grad=True)
        zero64 = torch.zeros(1, dtype=torch.float64)
        dpo_loss(pi_c, zero64, zero64, zero64, beta=1.0, label_smoothing=0.1)[0].backward()
        assert pi_c.grad is not None
        grad = pi_c.grad.item()
        assert grad == pytest.approx(0.0, abs=1e-12) if sign == 0 else grad * sign > 0


def test_dpo_loss_matches_reference() -> None:
    pi_c, pi_r, ref_c, ref_r = (_vec(s, 6, scale=4.0) for s in (41, 42, 43, 44))
    beta, ls = 0.2, 0.15
    loss, stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta, ls)
    chosen = [beta * (a - b) for a, b in zip(pi_c.tolist(), ref_c.tolist(), strict=True)]
    rejected = [beta * (c - d) for c, d in zip(pi_r.tolist(), ref_r.tolist(), strict=True)]
    zs = [c - r for c, r in zip(chosen, rejected, strict=True)]
    _close(loss, sum((1 - ls) * _softplus(-z) + ls * _softplus(z) for z in zs) / len(zs))
    assert 0 < stats["reward_accuracy"] < 1, "random case should hold wins and losses"
    assert stats["reward_accuracy"] == pytest.approx(sum(z > 0 for z in zs) / len(zs))
    assert stats["reward_margin"] == pytest.approx(sum(zs) / len(zs))
    assert stats["chosen_reward"] == pytest.approx(sum(chosen) / len(chosen))
    assert stats["rejected_reward"] == pytest.approx(sum(rejected) / len(rejected))


# ----- reward model -------------------------------------------------------------------------


def test_bradley_terry_by_hand() -> None:
    # margins 2, 0, -2 -> losses log(1 + e^-2), log 2, log(1 + e^2); the tie counts as wrong
    chosen = torch.tensor([2.0, 0.0, -1.0], requires_grad=True)
    rejected = torch.tensor([0.0, 0.0, 1.0])
    loss, stats = bradley_terry_loss(chosen, rejected)
    _close(loss.detach(), (_softplus(-2.0) + LN(2.0) + _softplus(2.0)) / 3, 1e-6)
    assert stats["accuracy"] == pytest.approx(1 / 3)
    assert stats["margin"] == pytest.approx(0.0)
    loss.backward()
    # dL/dc = -sigmoid(-m) / 3 < 0: descent raises the chosen score
    _close(chosen.grad, -torch.sigmoid(torch.tensor([-2.0, 0.0, 2.0])) / 3, 1e-6)


def test_bradley_terry_matches_reference() -> None:
    chosen, rejected = _vec(50, 9, scale=2.0), _vec(51, 9, scale=2.0)
    loss, stats = bradley_terry_loss(chosen, rejected)
    margins = [c - r for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True)]
    _close(loss, sum(_softplus(-m) for m in margins) / len(margins))
    assert 0 < stats["accuracy"] < 1
    assert stats["accuracy"] == pytest.approx(sum(m > 0 for m in margins) / len(margins))
    assert stats["margin"] == pytest.approx(sum(margins) / len(margins))


def test_final_token_scores() -> None:
    g = GARBAGE
    values = torch.tensor([[1.0, 2.0, 3.0, g], [4.0, g, g, g], [5.0, 6.0, 7.0, 8.0]])
    _close(final_token_scores(values, torch.tensor([3, 1, 4])), [3.0, 4.0, 8.0])
    values = _rand(52)
    lens = [1, 7, 3, 5, 2]
    expected = [row[n - 1] for row, n in zip(values.tolist(), lens, strict=True)]
    _close(final_token_scores(values, torch.tensor(lens)), expected)
    for bad in ([0, 1, 1, 1, 1], [8, 1, 1, 1, 1]):
        with pytest.raises(AssertionError, match="seq_lens"):
            final_token_scores(values, torch.tensor(bad))


# ----- SFT ----------------------------------------------------------------------------------


def test_sft_loss_by_hand() -> None:
    # logits [0, 0, ln 2] -> probs [1/4, 1/4, 1/2]: nll ln 2 and ln 4, mean 1.5 ln 2
    logits = torch.tensor([[[0.0, 0.0, LN(2.0)]] * 3, [[9.0, 0.0, 0.0]] * 3])
    labels = torch.tensor([[2, 0, -100], [-100, -100, -100]])
    loss, stats = sft_loss(logits, labels, _mask([2, 0], 3))
    _close(loss, 1.5 * LN(2.0), 1e-6)
    assert stats["nll"] == pytest.approx(1.5 * LN(2.0))


def test_sft_loss_equals_torch_cross_entropy() -> None:
    g = torch.Generator().manual_seed(53)
    logits = torch.randn(len(LENGTHS), T, 11, generator=g, requires_grad=True)
    mask = _mask(LENGTHS)
    labels = torch.randint(0, 11, (len(LENGTHS), T), generator=g).masked_fill(~mask, -100)
    loss, stats = sft_loss(logits, labels, mask)
    expected = F.cross_entropy(logits[mask], labels[mask])
    _close(loss, expected, 1e-6)
    _close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), 1e-6)
    assert stats["nll"] == pytest.approx(expected.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    _close(grad, expected_grad, 1e-6)
    empty, _ = sft_loss(logits, labels, torch.zeros_like(mask))
    assert empty.item() == 0.0
