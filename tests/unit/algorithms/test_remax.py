"""ReMax: config, greedy-baselined advantages and the REINFORCE loss, against hand-worked
numbers and slow loops; the ``remax_actor`` train call on a fake engine.

Random cases use rows of varied length, including an empty row, with garbage on the padding so
that any leak of padded values into a result shows up.
"""

import math

import pydantic
import pytest
import torch
from algo_support import LENGTHS, ScoresFromForward, _close, _mask, _pad, _rand, _valid, _vec

from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.algorithms.remax import ReMaxConfig, reinforce_loss, remax_advantages
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch
from rayhf.sampling import GenerationConfig

# ----- config -------------------------------------------------------------------------------


def test_config_defaults() -> None:
    r = ReMaxConfig()
    assert (r.kl_coef, r.reward_clip, r.n_minibatches, r.adv_norm) == (0.1, 20.0, 1, False)
    assert all(f.description for f in ReMaxConfig.model_fields.values())  # attribute docstrings


@pytest.mark.parametrize(
    "bad", [{"kl_coef": -1.0}, {"reward_clip": 0.0}, {"n_minibatches": 0}, {"no_such_field": 1}]
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        ReMaxConfig(**bad)


# ----- ReMax --------------------------------------------------------------------------------


def test_remax_advantages_by_hand() -> None:
    mask = _mask([3, 1, 2, 0], 3)
    sampled = torch.tensor([30.0, -1.0, 1.0, 5.0])
    greedy = torch.tensor([10.0, -25.0, 3.0, 0.0])
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 9.0, 9.0], [-1.0, -1.0, 9.0], [9.0] * 3])
    ref = torch.tensor([[-1.5, -2.0, -2.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, 0.0], [0.0] * 3])
    adv = remax_advantages(sampled, greedy, logp, ref, mask, kl_coef=0.1, reward_clip=20.0)
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
    kl_coef, clip = 0.05, 10.0
    adv = remax_advantages(sampled, greedy, logp, ref, _mask(LENGTHS), kl_coef, clip)
    clamp = lambda v: max(-clip, min(clip, v))  # noqa: E731
    expected = []
    for lp, rp, s, g in zip(
        _valid(logp), _valid(ref), sampled.tolist(), greedy.tolist(), strict=True
    ):
        rewards = [-kl_coef * (a - b) for a, b in zip(lp, rp, strict=True)]
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


# ----- the remax_actor interface ------------------------------------------------------------


class FakeEngine(ScoresFromForward):
    """A bigram model (logits at a position = ``table[its token]``) and the only dp rank;
    trains by calling the loss on each minibatch."""

    pad_id = 0

    def __init__(self, table: torch.Tensor, other_sums: torch.Tensor | None = None) -> None:
        self.table, self.losses, self.other_sums = table, [], other_sums

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]

    def all_reduce_mean(self, values):
        return dict(values)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """With ``other_sums``, rank 0 of two: the other rank's sums are added."""
        return t if self.other_sums is None else t + self.other_sums

    def train(self, minibatches, loss_fn):
        stats = {}
        for mb in minibatches:
            loss, stats = loss_fn(mb)
            self.losses.append(loss.item())
        return stats


def _rollouts() -> PackedBatch:
    """Prompt [2] + responses [3, 4], [5] and [] with sampled / greedy scores and log-probs."""
    b = PackedBatch([0, 1, 2])
    b.add("seq", torch.tensor([2, 3, 4, 2, 5, 2]), [3, 2, 1])
    b.add("prompt_lens", torch.ones(3, dtype=torch.long), [1, 1, 1])
    b.add("scores", torch.tensor([30.0, -1.0, 2.0]), [1, 1, 1])
    b.add("greedy_scores", torch.tensor([10.0, -25.0, 0.0]), [1, 1, 1])
    b.add("logprobs", torch.tensor([-1.0, -2.0, -0.5]), [2, 1, 0])
    b.add("ref_logprobs", torch.tensor([-1.5, -2.0, -1.0]), [2, 1, 0])
    return b


@pytest.mark.parametrize("adv_norm", [False, True])
def test_remax_train_step_adds_return_to_go_advantages(adv_norm: bool) -> None:
    table = torch.randn(8, 8, generator=torch.Generator().manual_seed(37))
    batch, engine = _rollouts(), FakeEngine(table)
    cfg = ReMaxConfig(kl_coef=0.1, reward_clip=20.0, n_minibatches=1, adv_norm=adv_norm)
    settings = InterfaceSettings(cfg, GenerationConfig(temperature=0.5))
    stats = make_interface("remax_actor", settings).train_step(
        engine, batch, CallContext(0, 0, 1, 0)
    )
    # kl 0.5, 0 | 0.5 -> rewards -0.05, 0 + (20 - 10) | -0.05 + (-1 - -20); return-to-go
    expected = torch.tensor([9.95, 10.0, 18.95])
    if adv_norm:
        expected = (expected - expected.mean()) / expected.std(unbiased=False)
    assert batch.seqlens["advantages"] == [2, 1, 0]
    _close(batch.tensors["advantages"], expected, 1e-5)
    assert stats["task_reward"] == pytest.approx(31 / 3)
    assert stats["greedy_reward"] == pytest.approx(-5.0)
    assert stats["kl"] == pytest.approx(1 / 3)  # (0.5 + 0 + 0.5) / 3 tokens
    # the loss is REINFORCE on the policy's log-probs at the sampling temperature
    logp = (table / 0.5).log_softmax(-1)
    policy = torch.stack([logp[2, 3], logp[3, 4], logp[2, 5]]).double()
    assert engine.losses == [pytest.approx(-(expected.double() * policy).mean().item(), rel=1e-5)]


def test_remax_whitens_over_every_data_parallel_rank_s_tokens() -> None:
    # the other rank holds two tokens, advantages 0 and 1: its sum, sum of squares and count
    engine = FakeEngine(torch.zeros(8, 8), torch.tensor([1.0, 1.0, 2.0], dtype=torch.float64))
    cfg = ReMaxConfig(kl_coef=0.1, reward_clip=20.0, adv_norm=True)
    iface = make_interface("remax_actor", InterfaceSettings(cfg, GenerationConfig()))
    batch = _rollouts()
    iface.train_step(engine, batch, CallContext(0, 0, 2, 0))
    mine = torch.tensor([9.95, 10.0, 18.95], dtype=torch.float64)
    everything = torch.cat([mine, torch.tensor([0.0, 1.0], dtype=torch.float64)])
    expected = (mine - everything.mean()) / everything.std(unbiased=False)
    alone = (mine - mine.mean()) / mine.std(unbiased=False)  # what whitening one rank gives
    assert (expected - alone).abs().min() > 0.1
    _close(batch.tensors["advantages"].double(), expected, 1e-5)


def test_remax_returns_run_over_a_multi_turn_sample_s_model_tokens() -> None:
    # response [3, 4, 5] whose middle token is the environment's (log-prob 9 there: not counted)
    b = PackedBatch([0])
    b.add("seq", torch.tensor([2, 3, 4, 5]), [4])
    b.add("prompt_lens", torch.ones(1, dtype=torch.long), [1])
    b.add("loss_mask", torch.tensor([True, False, True]), [3])
    b.add("scores", torch.tensor([30.0]), [1])
    b.add("greedy_scores", torch.tensor([10.0]), [1])
    b.add("logprobs", torch.tensor([-1.0, 9.0, -2.0]), [3])
    b.add("ref_logprobs", torch.tensor([-1.5, 0.0, -2.0]), [3])
    cfg = ReMaxConfig(kl_coef=0.1, reward_clip=20.0)
    iface = make_interface("remax_actor", InterfaceSettings(cfg, GenerationConfig()))
    iface.train_step(FakeEngine(torch.zeros(8, 8)), b, CallContext(0, 0, 1, 0))
    # model tokens' kl 0.5, 0 -> rewards -0.05, 0 + (30 - 10); returns 9.95, 10; 0 between
    assert b.seqlens["advantages"] == [3]
    _close(b.tensors["advantages"], [9.95, 0.0, 10.0], 1e-5)
