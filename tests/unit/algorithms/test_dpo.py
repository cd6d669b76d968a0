"""DPO: config, sequence log-probs and the loss, against hand-worked numbers and slow loops;
the ``dpo`` interface on a fake engine.

Random cases use rows of varied length, including an empty row, with garbage on the padding so
that any leak of padded values into a result shows up.
"""

import math

import pydantic
import pytest
import torch
from algo_support import LENGTHS, ScoresFromForward, _close, _mask, _rand, _softplus, _valid, _vec

from rayhf.algorithms.dpo import DPOConfig, dpo_loss, sequence_logprob
from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch

# ----- config -------------------------------------------------------------------------------


def test_config_defaults() -> None:
    d = DPOConfig()
    assert (d.beta, d.label_smoothing, d.n_minibatches) == (0.1, 0.0, 1)
    assert all(f.description for f in DPOConfig.model_fields.values())  # attribute docstrings


@pytest.mark.parametrize(
    "bad",
    [
        {"beta": 0.0},
        {"label_smoothing": 0.5},
        {"label_smoothing": -0.1},
        {"n_minibatches": 0},
        {"no_such_field": 1},
    ],
)
def test_config_rejects_bad_values(bad: dict) -> None:
    with pytest.raises(pydantic.ValidationError):
        DPOConfig(**bad)


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


# ----- the dpo interface --------------------------------------------------------------------


class BigramEngine(ScoresFromForward):
    """A model whose logits at a position are ``table[its token]``; trains by backpropagating
    each minibatch's loss."""

    pad_id = 0

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]

    def train(self, minibatches, loss_fn):
        stats = {}
        for mb in minibatches:
            loss, stats = loss_fn(mb)
            loss.backward()
        return stats


def _bigram_logprob(table: torch.Tensor, seq: list[int], prompt_len: int) -> float:
    """Summed log-prob of ``seq``'s response tokens, each given the token before it."""
    total = 0.0
    for prev, tok in zip(seq[prompt_len - 1 : -1], seq[prompt_len:], strict=True):
        zs = table[prev].tolist()
        total += zs[tok] - math.log(sum(math.exp(z) for z in zs))
    return total


PAIRS = [  # (prompt, chosen response, rejected response)
    ([2, 3], [4, 5], [6]),
    ([7], [8], [9, 10, 11]),
]


def _pair_batch() -> tuple[PackedBatch, list[tuple[float, float]]]:
    """The pairs with reference per-token log-probs; returns the reference sequence sums."""
    b = PackedBatch([0, 1])
    ref_sums = []
    for key, side in (("chosen", 1), ("rejected", 2)):
        seqs = [p[0] + p[side] for p in PAIRS]
        b.add(key, torch.tensor([t for s in seqs for t in s]), [len(s) for s in seqs])
        lens = [len(p[side]) for p in PAIRS]
        ref = -0.3 * torch.arange(1, sum(lens) + 1, dtype=torch.float32)
        b.add(f"ref_{key}_logprobs", ref, lens)
        ref_sums.append([float(b.sample(f"ref_{key}_logprobs", i).sum()) for i in range(2)])
    b.add("prompt_lens", torch.tensor([len(p[0]) for p in PAIRS]), [1, 1])
    return b, list(zip(*ref_sums, strict=True))


def test_dpo_interface_loss_from_the_policy_and_reference_sequence_logprobs() -> None:
    table = torch.randn(12, 12, generator=torch.Generator().manual_seed(60))
    batch, ref = _pair_batch()
    cfg = DPOConfig(beta=0.5, label_smoothing=0.1)
    iface = make_interface("dpo", InterfaceSettings(cfg, None))
    loss, stats = iface.loss(BigramEngine(table), batch)
    expected = []
    for (prompt, chosen, rejected), (ref_c, ref_r) in zip(PAIRS, ref, strict=True):
        pi_c = _bigram_logprob(table, prompt + chosen, len(prompt))
        pi_r = _bigram_logprob(table, prompt + rejected, len(prompt))
        z = 0.5 * ((pi_c - ref_c) - (pi_r - ref_r))
        expected.append(0.9 * _softplus(-z) + 0.1 * _softplus(z))
    _close(loss.detach(), sum(expected) / 2, 1e-5)
    assert stats["dpo_loss"] == pytest.approx(loss.item())
    assert set(stats) == {"dpo_loss", "reward_margin", "reward_accuracy", "chosen_reward",
                          "rejected_reward"}  # fmt: skip


def test_dpo_interface_train_step_raises_chosen_over_rejected() -> None:
    table = torch.zeros(12, 12, requires_grad=True)
    batch, _ = _pair_batch()
    iface = make_interface("dpo", InterfaceSettings(DPOConfig(n_minibatches=1), None))
    iface.train_step(BigramEngine(table), batch, CallContext(0, 0, 1, 0))
    assert table.grad is not None
    # descent raises the logit of each chosen token after its context, lowers each rejected one
    assert table.grad[3, 4] < 0 and table.grad[4, 5] < 0 and table.grad[7, 8] < 0
    assert table.grad[3, 6] > 0 and table.grad[7, 9] > 0 and table.grad[10, 11] > 0
