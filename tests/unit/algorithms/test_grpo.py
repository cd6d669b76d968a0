"""GRPO and Dr. GRPO: config, group advantages, k3 KL and the clipped loss, against
hand-worked numbers and slow loops; the ``grpo_actor`` interface on a fake engine.

Random cases use rows of varied length, including an empty row, with garbage on the padding so
that any leak of padded values into a result shows up.
"""

import math
import statistics

import pydantic
import pytest
import torch
from algo_support import LENGTHS, LN, ScoresFromForward, _close, _mask, _pad, _rand, _valid, _vec

from rayhf.algorithms.grpo import (
    GRPOConfig,
    group_advantages,
    grpo_advantages,
    grpo_loss,
    k3_kl,
    kl_loss_term,
)
from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.sampling import GenerateOutput, GenerationConfig

# ----- config -------------------------------------------------------------------------------


def test_config_defaults() -> None:
    g = GRPOConfig()
    assert (g.group_size, g.kl_coef, g.eps_clip, g.eps) == (4, 0.04, 0.2, 1e-6)
    assert (g.dr_grpo, g.max_new_tokens_norm, g.n_minibatches, g.ppo_epochs) == (False, None, 4, 1)
    assert all(f.description for f in GRPOConfig.model_fields.values())  # attribute docstrings


@pytest.mark.parametrize(
    "bad",
    [
        {"group_size": 1},
        {"kl_coef": -0.1},
        {"eps_clip": 0.0},
        {"eps": 0.0},
        {"max_new_tokens_norm": 0},
        {"n_minibatches": 0},
        {"ppo_epochs": 0},
        {"no_such_field": 1},
    ],
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        GRPOConfig(**bad)


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
    # same tokens, Dr. GRPO: sum -1.4 / (B * norm) = -1.4 / (3 * 2); with norm 4: / 12
    new, old, adv, mask = _clip_case()
    two = GRPOConfig(dr_grpo=True, max_new_tokens_norm=2)
    loss, _ = grpo_loss(new, old, new.detach(), adv, mask, two)
    _close(loss.detach(), -1.4 / 6, 1e-6)
    loss.backward()
    _close(new.grad, [[0.0, -0.5 / 6], [1.5 / 6, 0.0], [-2 / 6, 0.0]], 1e-6)
    cfg = GRPOConfig(dr_grpo=True, max_new_tokens_norm=4)
    _close(grpo_loss(new, old, new, adv, mask, cfg)[0].detach(), -1.4 / 12, 1e-6)
    for short in (1, None):  # the interface fills None with max_new_tokens
        with pytest.raises(RayhfError, match="max_new_tokens_norm"):
            grpo_loss(new, old, new, adv, mask, GRPOConfig(dr_grpo=True, max_new_tokens_norm=short))


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
    # Dr. GRPO: 1 / (B * norm) whatever the other rows hold.
    def weights(lengths: list[int], cfg: GRPOConfig) -> torch.Tensor:
        logp = torch.zeros(3, 6, requires_grad=True)
        const = logp.detach()
        loss, _ = grpo_loss(logp, const, const, torch.ones(3), _mask(lengths, 6), cfg)
        loss.backward()
        assert logp.grad is not None
        return -logp.grad

    mean_cfg = GRPOConfig(kl_coef=0.0)
    dr_cfg = GRPOConfig(kl_coef=0.0, dr_grpo=True, max_new_tokens_norm=4)
    fixed_cfg = GRPOConfig(kl_coef=0.0, dr_grpo=True, max_new_tokens_norm=8)
    w = weights([1, 4, 0], mean_cfg)
    _close(w[0, 0], 0.2)
    _close(w.sum(dim=1), [0.2, 0.8, 0.0])
    _close(weights([1, 1, 0], mean_cfg)[0, 0], 0.5)
    _close(weights([1, 4, 0], dr_cfg)[:2, :4], [[1 / 12, 0, 0, 0], [1 / 12] * 4])
    _close(weights([1, 4, 0], fixed_cfg)[0, 0], 1 / 24)
    _close(weights([1, 1, 0], fixed_cfg)[0, 0], 1 / 24)


@pytest.mark.parametrize("dr_grpo,norm", [(False, None), (True, 7), (True, 10)])
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
    cfg = GRPOConfig(dr_grpo=dr_grpo, max_new_tokens_norm=4 if dr_grpo else None)
    loss, stats = grpo_loss(new, torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), mask, cfg)
    loss.backward()
    assert loss.item() == 0.0 and all(v == 0.0 for v in stats.values())
    assert new.grad is not None and torch.isfinite(new.grad).all()


# ----- the grpo_actor interface -------------------------------------------------------------


class FakeEngine(ScoresFromForward):
    """A bigram model (logits at a position = ``table[its token]``), one of several dp ranks
    (``others``: the other ranks' gathered objects, in rank order around this one's ``rank``)."""

    pad_id, eos_id = 0, 1

    def __init__(self, table: torch.Tensor, others: list = (), rank: int = 0) -> None:
        self.table, self.others, self.rank = table, list(others), rank
        self.prompts: list[list[int]] = []
        self.losses: list[float] = []
        self.minibatch_ids: list[list[int]] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]

    def generate(self, prompts, cfg, seed):
        self.prompts = prompts
        tokens = [[3 + i, 1] for i in range(len(prompts))]
        return GenerateOutput(tokens, [[-1.0, -2.0]] * len(prompts), [True] * len(prompts))

    def all_gather_object(self, obj):
        return [*self.others[: self.rank], obj, *self.others[self.rank :]]

    def all_reduce_mean(self, values):
        return dict(values)

    def all_reduce_sum(self, t):
        return t

    def micro_batches(self, batch):
        return [batch]

    def train(self, minibatches, loss_fn, *_):
        stats = {}
        for mb in minibatches:
            loss, stats = loss_fn(mb)
            self.losses.append(loss.item())
            self.minibatch_ids.append(mb.sample_ids)
        return stats


def _actor(**cfg) -> object:
    return make_interface("grpo_actor", InterfaceSettings(GRPOConfig(**cfg), GenerationConfig()))


def test_grpo_generate_samples_group_size_responses_per_prompt() -> None:
    prompts = PackedBatch([4, 9])
    prompts.add("prompts", torch.tensor([5, 6, 7]), [2, 1])
    engine = FakeEngine(torch.zeros(12, 12))
    out = _actor(group_size=3).generate(engine, prompts, CallContext(0, 0, 1, 0))
    assert engine.prompts == [[5, 6]] * 3 + [[7]] * 3
    assert out.sample_ids == [12, 13, 14, 27, 28, 29]
    assert out.tensors["group_ids"].tolist() == [4, 4, 4, 9, 9, 9]


def _rollouts(scores: list[float], groups: list[int]) -> PackedBatch:
    """Prompt [2] + response [3, 4] per sample, with old and ref log-probs left to fill."""
    n = len(scores)
    b = PackedBatch(list(range(n)))
    b.add("seq", torch.tensor([2, 3, 4] * n), [3] * n)
    b.add("prompt_lens", torch.ones(n, dtype=torch.long), [1] * n)
    b.add("scores", torch.tensor(scores), [1] * n)
    b.add("group_ids", torch.tensor(groups), [1] * n)
    return b


def test_grpo_advantages_use_group_members_on_other_ranks() -> None:
    # group 0 has a sample on each rank, group 1 two on rank 0: normalized over all of them
    rank0 = (torch.tensor([0, 1, 1]), torch.tensor([1.0, 2.0, 6.0]))
    mine = _rollouts([3.0, 5.0], [0, 2])
    engine = FakeEngine(torch.zeros(12, 12), others=[rank0], rank=1)
    adv = _actor(eps=1e-9).advantages(engine, mine, rank=1)
    everyone = group_advantages(
        torch.tensor([1.0, 2.0, 6.0, 3.0, 5.0]), torch.tensor([0, 1, 1, 0, 2]), 1e-9
    )
    _close(adv, everyone[3:])
    _close(adv, [1 / math.sqrt(2.0), 0.0], 1e-6)  # (3 - 2) / sample std sqrt 2; group of one: 0


def test_grpo_train_step_at_ratio_one_is_minus_the_token_mean_advantage() -> None:
    table = torch.randn(12, 12, generator=torch.Generator().manual_seed(28))
    batch = _rollouts([0.0, 4.0, 1.0, 1.0], [0, 0, 1, 1])
    logp = table.log_softmax(-1)
    current = torch.stack([logp[2, 3], logp[3, 4]]).repeat(4)  # the policy's own log-probs
    batch.add("logprobs", current, [2] * 4)
    batch.add("ref_logprobs", current, [2] * 4)
    engine = FakeEngine(table)
    stats = _actor(n_minibatches=2, ppo_epochs=3).train_step(engine, batch, CallContext(0, 0, 1, 0))
    assert len(engine.losses) == 2 * 3  # n_minibatches steps per epoch
    assert stats["task_reward"] == pytest.approx(1.5) and stats["response_len"] == 2.0
    assert stats["clip_frac"] == 0.0 and stats["kl"] == pytest.approx(0.0, abs=1e-6)
    # advantages -1/sqrt 2, +1/sqrt 2 in group 0 and 0, 0 in group 1; every sample has 2 tokens
    adv = batch.tensors["advantages"]
    _close(adv, [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0, 0.0], 1e-5)
    for ids, loss in zip(engine.minibatch_ids, engine.losses, strict=True):
        assert loss == pytest.approx(-adv[ids].mean().item(), abs=1e-6)
    assert sorted(i for ids in engine.minibatch_ids[:2] for i in ids) == [0, 1, 2, 3]


def test_dr_grpo_divides_by_max_new_tokens_whatever_the_batch_holds() -> None:
    """A 2-token response's token weighs 1 / (B * max_new_tokens) beside an 8-token row and
    beside a 2-token row alike; dividing by the batch's longest row gave 1/16 and 1/4."""
    actor = make_interface(
        "grpo_actor",
        InterfaceSettings(
            GRPOConfig(dr_grpo=True, kl_coef=0.0), GenerationConfig(max_new_tokens=8)
        ),
    )

    def weight(other: int) -> float:
        logp = torch.zeros(2, 8, requires_grad=True)
        const = logp.detach()
        loss, _ = actor.policy_loss(logp, const, const, torch.ones(2), _mask([2, other], 8), None)  # type: ignore[attr-defined]
        loss.backward()
        assert logp.grad is not None
        return -float(logp.grad[0, 0])

    assert weight(8) == pytest.approx(1 / 16) and weight(2) == pytest.approx(1 / 16)


def test_the_kl_estimators_by_hand() -> None:
    logp = torch.zeros(1, 2)
    ref = torch.tensor([[LN(2), -LN(2)]])  # d = logp - ref = -ln 2, ln 2
    mask = torch.ones(1, 2, dtype=torch.bool)
    _close(kl_loss_term(logp, ref, mask, "k1"), [[-LN(2), LN(2)]])
    _close(kl_loss_term(logp, ref, mask, "k2"), [[LN(2) ** 2 / 2] * 2])
    _close(kl_loss_term(logp, ref, mask, "k3"), k3_kl(logp, ref, mask))
    assert GRPOConfig().kl_estimator == "k3"


def test_dr_grpo_divides_a_multi_turn_trajectory_by_env_max_tokens() -> None:
    """A trajectory's turns together may pass one turn's max_new_tokens: Dr. GRPO's default
    divisor for the agent interface is ``env.max_tokens`` (it never fails on a long one)."""
    from rayhf.envs.env import EnvConfig

    settings = InterfaceSettings(
        GRPOConfig(dr_grpo=True, kl_coef=0.0),
        GenerationConfig(max_new_tokens=4),
        env=EnvConfig(cls="rayhf.tasks.calculator:CalculatorEnv", max_tokens=16),
    )
    actor = make_interface("grpo_agent", settings)
    logp = torch.zeros(1, 10, requires_grad=True)
    const = logp.detach()
    loss, _ = actor.policy_loss(logp, const, const, torch.ones(1), _mask([10], 10), None)  # type: ignore[attr-defined]
    loss.backward()
    assert logp.grad is not None and -float(logp.grad[0, 0]) == pytest.approx(1 / 16)
