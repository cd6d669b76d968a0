"""PPO math checked twice: against numbers worked out by hand and against slow Python loops.

Random cases use rows of varied length, including an empty row, with garbage on the padding so
that any leak of padded values into a result shows up.
"""

import math
import pickle

import pydantic
import pytest
import torch
from algo_support import LENGTHS, T, _close, _mask, _rand, _valid

from rayhf.algorithms.lm import entropy_from_logits
from rayhf.algorithms.offpolicy import OffPolicyConfig
from rayhf.algorithms.ppo import (
    AdaptiveKLController,
    FixedKLController,
    PPOConfig,
    gae_advantages,
    kl_shaped_rewards,
    make_kl_controller,
    masked_mean,
    ppo_policy_loss,
    ppo_value_loss,
)

# ----- config -------------------------------------------------------------------------------


def test_config_defaults_follow_realhf() -> None:
    cfg = PPOConfig()
    assert (cfg.kl_coef, cfg.adaptive_kl, cfg.kl_target, cfg.kl_horizon) == (0.1, False, 6.0, 10000)
    assert (cfg.gamma, cfg.lam, cfg.eps_clip, cfg.value_eps_clip) == (1.0, 1.0, 0.2, 0.2)
    assert (cfg.reward_clip, cfg.n_minibatches, cfg.ppo_epochs) == (20.0, 4, 1)
    assert (cfg.adv_norm, cfg.entropy_coef) == (True, 0.0)
    assert PPOConfig.model_fields["eps_clip"].description  # attribute docstrings are kept


@pytest.mark.parametrize(
    "bad",
    [
        {"eps_clip": 0.0},
        {"value_eps_clip": -0.1},
        {"reward_clip": 0.0},
        {"kl_target": 0.0},
        {"kl_horizon": 0},
        {"n_minibatches": 0},
        {"ppo_epochs": 0},
        {"gamma": 1.5},
        {"lam": -0.1},
        {"kl_coef": -1.0},
        {"entropy_coef": -0.01},
        {"no_such_field": 1},
    ],
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        PPOConfig(**bad)


# ----- masked statistics --------------------------------------------------------------------


def test_masked_mean_by_hand() -> None:
    nan = float("nan")
    x = torch.tensor([[1.0, 2.0, nan], [4.0, nan, nan], [nan, nan, nan]])
    mask = _mask([2, 1, 0], 3)
    _close(masked_mean(x, mask), 7.0 / 3.0, 1e-6)  # (1 + 2 + 4) / 3, NaN padding ignored
    _close(masked_mean(x, mask, dim=1), [1.5, 4.0, 0.0], 1e-6)  # empty row -> 0
    _close(masked_mean(x, torch.zeros_like(mask)), 0.0)


def test_masked_mean_matches_reference() -> None:
    x = _rand(0)
    rows = _valid(x)
    flat = [v for row in rows for v in row]
    _close(masked_mean(x, _mask(LENGTHS)), sum(flat) / len(flat))
    per_row = [sum(r) / len(r) if r else 0.0 for r in rows]
    _close(masked_mean(x, _mask(LENGTHS), dim=1), per_row)


# ----- entropy ------------------------------------------------------------------------------


def test_entropy_by_hand_and_reference() -> None:
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, math.log(2.0), -1e9]]])
    # uniform over 4 -> ln 4; [1/4, 1/4, 1/2, 0] -> 1/2 ln 4 + 1/2 ln 2 = 1.5 ln 2
    _close(entropy_from_logits(logits), [[math.log(4.0), 1.5 * math.log(2.0)]], 1e-6)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 5, generator=g)
    ref = []
    for b in range(2):
        row = []
        for t in range(3):
            es = [math.exp(v) for v in logits[b, t].tolist()]
            ps = [e / sum(es) for e in es]
            row.append(-sum(p * math.log(p) for p in ps))
        ref.append(row)
    _close(entropy_from_logits(logits), ref, 1e-5)


# ----- reward shaping -----------------------------------------------------------------------


def test_kl_shaped_rewards_by_hand() -> None:
    mask = _mask([3, 1, 0], 3)
    scores = torch.tensor([30.0, -1.0, 5.0])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 9.0, 9.0], [9.0, 9.0, 9.0]])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref, mask, kl_coef=0.1, reward_clip=20.0)
    _close(kl, [[0.5, 0.0, -1.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]], 1e-6)
    # row 0: -0.1 * kl, last token gets clip(30) = 20 -> 0.1 + 20; row 1: -0.05 - 1;
    # row 2 is empty, so its score is dropped
    expected = [[-0.05, 0.0, 20.1], [-1.05, 0.0, 0.0], [0.0, 0.0, 0.0]]
    _close(rewards, expected, 1e-6)


def test_kl_shaped_rewards_matches_reference() -> None:
    scores = torch.tensor([50.0, -3.0, -40.0, 0.5, 19.0], dtype=torch.float64)
    logprobs, ref = _rand(4), _rand(5)
    kl_coef, clip = 0.05, 10.0
    rewards, kl = kl_shaped_rewards(scores, logprobs, ref, _mask(LENGTHS), kl_coef, clip)
    exp_r, exp_k = [], []
    for lp, rp, s, n in zip(_valid(logprobs), _valid(ref), scores.tolist(), LENGTHS, strict=True):
        k = [a - b for a, b in zip(lp, rp, strict=True)]
        r = [-kl_coef * v for v in k]
        if n:
            r[-1] += max(-clip, min(clip, s))
        exp_k.append(k + [0.0] * (T - n))
        exp_r.append(r + [0.0] * (T - n))
    _close(kl, exp_k)
    _close(rewards, exp_r)


# ----- GAE ----------------------------------------------------------------------------------


def test_gae_by_hand() -> None:
    mask = _mask([2, 3, 0], 3)
    rewards = torch.tensor([[1.0, 2.0, 7.0], [0.0, 0.0, 1.0], [4.0, 4.0, 4.0]])
    values = torch.tensor([[0.5, 1.0, 3.0], [0.2, 0.4, 0.6], [1.0, 1.0, 1.0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d1 = 2 + 0 - 1 = 1, A1 = 1; d0 = 1 + 0.9 * 1 - 0.5 = 1.4, A0 = 1.4 + 0.72 * 1
    # row 1: d2 = 1 - 0.6 = 0.4; d1 = 0 + 0.54 - 0.4 = 0.14; d0 = 0 + 0.36 - 0.2 = 0.16
    #        A2 = 0.4, A1 = 0.14 + 0.72 * 0.4 = 0.428, A0 = 0.16 + 0.72 * 0.428 = 0.46816
    _close(adv, [[2.12, 1.0, 0.0], [0.46816, 0.428, 0.4], [0.0, 0.0, 0.0]], 1e-6)
    _close(ret, [[2.62, 2.0, 0.0], [0.66816, 0.828, 1.0], [0.0, 0.0, 0.0]], 1e-6)
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t, returns = 1 everywhere in row 1
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    _close(adv[1], [0.8, 0.6, 0.4], 1e-6)
    _close(ret[1], [1.0, 1.0, 1.0], 1e-6)


def _gae_reference(rewards, values, gamma, lam):
    n = len(rewards)
    adv = [0.0] * n
    for t in range(n):  # direct sum, not the recursion, so the two methods differ
        for k in range(t, n):
            next_v = values[k + 1] if k + 1 < n else 0.0
            delta = rewards[k] + gamma * next_v - values[k]
            adv[t] += (gamma * lam) ** (k - t) * delta
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


@pytest.mark.parametrize("gamma,lam", [(0.9, 0.8), (1.0, 1.0), (0.99, 0.0), (0.0, 0.95)])
def test_gae_matches_reference(gamma: float, lam: float) -> None:
    rewards, values = _rand(6), _rand(7)
    adv, ret = gae_advantages(rewards, values, _mask(LENGTHS), gamma, lam)
    exp_a, exp_r = [], []
    for r, v, n in zip(_valid(rewards), _valid(values), LENGTHS, strict=True):
        a, ret_row = _gae_reference(r, v, gamma, lam)
        exp_a.append(a + [0.0] * (T - n))
        exp_r.append(ret_row + [0.0] * (T - n))
    _close(adv, exp_a)
    _close(ret, exp_r)


# ----- policy loss --------------------------------------------------------------------------


def test_policy_loss_clip_cases_by_hand() -> None:
    # eps 0.2. Tokens (A, ratio) -> max(-A r, -A clip(r)):
    #   (+1, 1.5) -> max(-1.5, -1.2) = -1.2 clipped    (+1, 0.5) -> max(-0.5, -0.8) = -0.5
    #   (-1, 1.5) -> max( 1.5,  1.2) =  1.5            (-1, 0.5) -> max( 0.5,  0.8) =  0.8 clipped
    #   (+2, 1.0) -> -2
    # mean = (-1.2 - 0.5 + 1.5 + 0.8 - 2) / 5 = -0.28, clip_frac 2/5
    ln = math.log
    new = torch.tensor([[ln(1.5), ln(0.5), ln(1.5)], [ln(0.5), 0.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -50.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [-1.0, 2.0, 1e6]])
    loss, stats = ppo_policy_loss(new, old, adv, _mask([3, 2], 3), eps_clip=0.2)
    _close(loss.detach(), -0.28, 1e-6)
    assert stats["clip_frac"] == pytest.approx(0.4)
    assert stats["approx_kl"] == pytest.approx(-2 * ln(0.75) / 5)  # mean(old - new)
    assert stats["ratio_mean"] == pytest.approx(1.0)  # (1.5 + 0.5 + 1.5 + 0.5 + 1) / 5
    loss.backward()
    # clipped tokens get no gradient; others d(-A r)/d logp / 5 = -A r / 5
    _close(new.grad, [[0.0, -0.1, 0.3], [0.0, -0.4, 0.0]], 1e-6)


def test_policy_loss_matches_reference() -> None:
    new, old, adv = _rand(8, scale=0.5), _rand(9, scale=0.5), _rand(10)
    eps = 0.1
    loss, stats = ppo_policy_loss(new, old, adv, _mask(LENGTHS), eps)
    losses, clipped, kls, ratios, dual = [], [], [], [], []
    rows = zip(_valid(new), _valid(old), _valid(adv), strict=True)
    for n_row, o_row, a_row in rows:
        for n, o, a in zip(n_row, o_row, a_row, strict=True):
            r = math.exp(n - o)
            l1, l2 = -a * r, -a * max(1 - eps, min(1 + eps, r))
            worst = max(l1, l2)
            dual.append(float(a < 0 and worst > -3 * a))
            losses.append(min(worst, -3 * a) if a < 0 else worst)  # dual clip, c = 3
            clipped.append(float(l2 > l1))
            kls.append(o - n)
            ratios.append(r)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    _close(loss, mean(losses))
    assert stats["dual_clip_frac"] == pytest.approx(mean(dual)) and sum(dual) > 0
    assert 0 < stats["clip_frac"] < 1, "random case should exercise both branches"
    assert stats["clip_frac"] == pytest.approx(mean(clipped))
    assert stats["approx_kl"] == pytest.approx(mean(kls))
    assert stats["ratio_mean"] == pytest.approx(mean(ratios))


def test_losses_with_no_valid_tokens_are_zero_and_finite() -> None:
    mask = torch.zeros(2, 3, dtype=torch.bool)
    new = torch.full((2, 3), -float("inf"), requires_grad=True)
    loss, stats = ppo_policy_loss(new, torch.zeros(2, 3), torch.ones(2, 3), mask, 0.2)
    loss.backward()
    assert loss.item() == 0.0 and all(v == 0.0 for v in stats.values())
    assert torch.isfinite(new.grad).all()
    v = torch.ones(2, 3, requires_grad=True)
    vloss, vstats = ppo_value_loss(v, torch.zeros(2, 3), torch.zeros(2, 3), mask, 0.2)
    vloss.backward()
    assert vloss.item() == 0.0 and vstats["value_clip_frac"] == 0.0
    assert torch.isfinite(v.grad).all()


# ----- value loss ---------------------------------------------------------------------------


def test_value_loss_by_hand() -> None:
    # eps 0.2, old 0, return R. (v, R) -> max((v - R)^2, (clip(v, -0.2, 0.2) - R)^2):
    #   (1, 1)    -> max(0, 0.64) = 0.64 clipped   (0.1, 1) -> 0.81 both (not clipped)
    #   (-1, 1)   -> max(4, 1.44) = 4
    # loss = 0.5 * (0.64 + 0.81 + 4) / 3, value_clip_frac = 1/3
    values = torch.tensor([[1.0, 0.1], [-1.0, 99.0], [5.0, 5.0]], requires_grad=True)
    old = torch.zeros(3, 2)
    returns = torch.tensor([[1.0, 1.0], [1.0, -99.0], [0.0, 0.0]])
    loss, stats = ppo_value_loss(values, old, returns, _mask([2, 1, 0], 2), eps_clip=0.2)
    _close(loss.detach(), 0.5 * 5.45 / 3, 1e-6)
    assert stats["value_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    # clipped token: no gradient; others 0.5 * 2 (v - R) / 3
    _close(values.grad, [[0.0, -0.3], [-2 / 3, 0.0], [0.0, 0.0]], 1e-6)


def test_value_loss_matches_reference() -> None:
    values, old, returns = _rand(11), _rand(12), _rand(13)
    eps = 0.3
    loss, stats = ppo_value_loss(values, old, returns, _mask(LENGTHS), eps)
    losses, clipped = [], []
    rows = zip(_valid(values), _valid(old), _valid(returns), strict=True)
    for v_row, o_row, r_row in rows:
        for v, o, r in zip(v_row, o_row, r_row, strict=True):
            vc = o + max(-eps, min(eps, v - o))
            l1, l2 = (v - r) ** 2, (vc - r) ** 2
            losses.append(max(l1, l2))
            clipped.append(float(l2 > l1))
    _close(loss, 0.5 * sum(losses) / len(losses))
    assert 0 < stats["value_clip_frac"] < 1, "random case should exercise both branches"
    assert stats["value_clip_frac"] == pytest.approx(sum(clipped) / len(clipped))


# ----- KL controllers -----------------------------------------------------------------------


def test_adaptive_kl_moves_towards_target() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=1000)  # error 0.5 clipped to 0.2 -> 0.1 * 1.02
    assert ctl.value == pytest.approx(0.102)
    ctl.load_state_dict({"value": 0.1, "target": 6.0, "horizon": 10000})
    ctl.update(current_kl=6.6, n_steps=1000)  # error 0.1 -> 0.1 * 1.01
    assert ctl.value == pytest.approx(0.101)
    ctl.value = 0.1
    ctl.update(current_kl=3.0, n_steps=1000)  # error -0.5 clipped to -0.2 -> 0.1 * 0.98
    assert ctl.value == pytest.approx(0.098)
    ctl.update(current_kl=6.0, n_steps=1000)  # on target: unchanged
    assert ctl.value == pytest.approx(0.098)


def test_kl_controllers_state_and_pickle() -> None:
    ctl = AdaptiveKLController(0.2, target=4.0, horizon=100)
    ctl.update(10.0, 50)
    restored = AdaptiveKLController(1.0, target=1.0, horizon=1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict() == pickle.loads(pickle.dumps(ctl)).state_dict()
    restored.update(0.0, 50)
    ctl.update(0.0, 50)
    assert restored.value == ctl.value == pytest.approx(0.2 * 1.1 * 0.9)  # up 10%, down 10%
    fixed = FixedKLController(0.3)
    fixed.update(100.0, 10**6)
    assert fixed.value == 0.3
    other = FixedKLController(0.0)
    other.load_state_dict(pickle.loads(pickle.dumps(fixed)).state_dict())
    assert other.value == 0.3


def test_make_kl_controller_follows_config() -> None:
    fixed = make_kl_controller(PPOConfig(kl_coef=0.05))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    cfg = PPOConfig(kl_coef=0.05, adaptive_kl=True, kl_target=2.0, kl_horizon=500)
    adaptive = make_kl_controller(cfg)
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.05, 2.0, 500)


def _multi_turn(flags: list[list[bool]], seed: int = 0):
    """A batch of right-padded-free multi-turn samples: every response token has a log-prob, a
    reference log-prob and a value; ``flags`` marks the model's tokens (``loss_mask``)."""
    from rayhf.data.batch import PackedBatch

    gen = torch.Generator().manual_seed(seed)
    batch = PackedBatch(list(range(len(flags))))
    lens = [len(f) for f in flags]
    batch.add("seq", torch.arange(sum(lens) + 3 * len(lens)), [n + 3 for n in lens])
    batch.add("prompt_lens", torch.full((len(lens),), 3), [1] * len(lens))
    for key in ("logprobs", "ref_logprobs", "values"):
        batch.add(key, torch.randn(sum(lens), generator=gen), lens)
    batch.add("scores", torch.tensor([1.0, -0.5][: len(lens)]), [1] * len(lens))
    batch.add("loss_mask", torch.tensor([x for f in flags for x in f]), lens)
    return batch


def test_multi_turn_gae_runs_over_the_model_s_tokens_only() -> None:
    """Advantages and returns of a trajectory with environment tokens between its turns are
    those of the model's tokens alone (the environment's skipped, not steps), and 0 on the
    environment's tokens; the reward lands on the last model token."""
    from rayhf.algorithms.interface import InterfaceSettings
    from rayhf.algorithms.ppo import PPOActorInterface
    from rayhf.algorithms.seqs import response_index
    from rayhf.sampling import GenerationConfig

    flags = [[True, True, False, False, True, True, False], [True, False, True, True]]
    batch = _multi_turn(flags)
    cfg = PPOConfig(gamma=0.9, lam=0.8)
    iface = PPOActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    _, mask = response_index(batch)
    adv, returns, _, rewards = iface.advantages(batch, mask)
    for i, row in enumerate(flags):
        keep, n = torch.tensor(row), len(row)
        logp, ref, values = (batch.sample(k, i)[keep].unsqueeze(0)
                             for k in ("logprobs", "ref_logprobs", "values"))  # fmt: skip
        one = torch.ones(1, int(keep.sum()), dtype=torch.bool)
        scores = batch.tensors["scores"][i : i + 1]
        r, _ = kl_shaped_rewards(scores, logp, ref, one, cfg.kl_coef, cfg.reward_clip)
        a, ret = gae_advantages(r, values, one, cfg.gamma, cfg.lam)
        _close(adv[i, :n][keep], a[0])
        _close(returns[i, :n][keep], ret[0])
        _close(rewards[i, :n][keep], r[0])
        assert torch.all(adv[i, :n][~keep] == 0) and torch.all(rewards[i, :n][~keep] == 0)
    # without a loss mask nothing moves: the same numbers as the single-turn path
    plain = _multi_turn([[True] * 7, [True] * 4])
    del plain.tensors["loss_mask"], plain.seqlens["loss_mask"]
    _, full = response_index(plain)
    a2, _, _, _ = iface.advantages(plain, full)
    r, _ = kl_shaped_rewards(plain.tensors["scores"], plain.to_padded("logprobs")[0],
                             plain.to_padded("ref_logprobs")[0], full, cfg.kl_coef,
                             cfg.reward_clip)  # fmt: skip
    a, _ = gae_advantages(r, plain.to_padded("values")[0], full, cfg.gamma, cfg.lam)
    assert torch.equal(a2, a)


@pytest.mark.parametrize("loss", ["ppo", "grpo", "gspo"])
def test_a_huge_log_ratio_leaves_the_loss_and_its_gradient_finite(loss: str) -> None:
    """One token 90 nats likelier than the old policy said: exp(90) is inf in float32, so the
    unbounded ratio gave a NaN loss or gradient even with a positive advantage (the clip picks
    the other side, and 0 * inf is NaN)."""
    from rayhf.algorithms.grpo import GRPOConfig, grpo_loss
    from rayhf.algorithms.gspo import GSPOConfig, gspo_loss

    new = torch.tensor([[90.0, 0.0]], requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    if loss == "ppo":
        out, _ = ppo_policy_loss(new, old, torch.ones(1, 2), mask, 0.2)
    elif loss == "grpo":
        out, _ = grpo_loss(new, old, old, torch.ones(1), mask, GRPOConfig())
    else:
        out, _ = gspo_loss(new, old, old, torch.ones(1), mask, GSPOConfig())
    out.backward()
    assert torch.isfinite(out) and new.grad is not None and torch.isfinite(new.grad).all()


def test_dual_clip_bounds_a_negative_advantage_s_loss_by_hand() -> None:
    """A = -1, ratio e^2 ~ 7.4: the clipped surrogate is max(7.4, 1.2) = 7.4; dual clip c = 3
    bounds it at 3 (no gradient), verl's default; dual_clip None leaves 7.4."""
    new = torch.tensor([[2.0, 0.0]], requires_grad=True)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    adv = torch.tensor([[-1.0, -1.0]])
    loss, stats = ppo_policy_loss(new, old, adv, mask, 0.2)
    _close(loss.detach(), (3.0 + 1.0) / 2, 1e-6)
    assert stats["dual_clip_frac"] == 0.5
    loss.backward()
    assert new.grad is not None and new.grad[0, 0] == 0.0
    off = OffPolicyConfig(dual_clip=None)
    _close(
        ppo_policy_loss(new, old, adv, mask, 0.2, cfg=off)[0].detach(), (math.exp(2) + 1) / 2, 1e-6
    )


def test_kl_shaped_rewards_of_rows_with_no_token_at_all() -> None:
    """A batch whose trained tokens are none (every token the environment's, compacted to
    width 0) gets empty rewards, not an index error."""
    empty = torch.zeros(2, 0)
    rewards, kl = kl_shaped_rewards(torch.ones(2), empty, empty, empty.bool(), 0.1, 5.0)
    assert rewards.shape == (2, 0) and kl.shape == (2, 0)
