"""Reward-model training: the Bradley-Terry loss and final-token scores, against hand-worked
numbers and slow loops; the ``rm`` interface on a fake engine.

Random cases use rows of varied length, including an empty row, with garbage on the padding so
that any leak of padded values into a result shows up.
"""

import pydantic
import pytest
import torch
from algo_support import GARBAGE, LN, _close, _rand, _softplus, _vec

from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.algorithms.rm import RMConfig, bradley_terry_loss, final_token_scores
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch

# ----- config -------------------------------------------------------------------------------


def test_config_defaults_and_bad_values() -> None:
    assert RMConfig().n_minibatches == 1
    assert all(f.description for f in RMConfig.model_fields.values())  # attribute docstrings
    for bad in ({"n_minibatches": 0}, {"no_such_field": 1}):
        with pytest.raises(pydantic.ValidationError):
            RMConfig(**bad)


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


# ----- the rm interface ---------------------------------------------------------------------


class ValueEngine:
    """A value-head model whose value at a position is ``values[its token]``."""

    pad_id = 0

    def __init__(self, values: torch.Tensor) -> None:
        self.values, self.steps = values, 0

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.values[input_ids] * attention_mask

    def train(self, minibatches, loss_fn):
        stats = {}
        for mb in minibatches:
            loss, stats = loss_fn(mb)
            loss.backward()
            self.steps += 1
        return stats


def _pairs() -> PackedBatch:
    """Chosen [1, 2, 3] vs rejected [1, 4]; chosen [5, 6] vs rejected [5, 7, 8, 9]."""
    b = PackedBatch([0, 1])
    b.add("chosen", torch.tensor([1, 2, 3, 5, 6]), [3, 2])
    b.add("rejected", torch.tensor([1, 4, 5, 7, 8, 9]), [2, 4])
    b.add("prompt_lens", torch.tensor([1, 1]), [1, 1])
    return b


def test_rm_interface_scores_each_side_by_its_final_token() -> None:
    values = torch.tensor([0.0, 9.0, 9.0, 2.0, -1.0, 9.0, 0.5, 9.0, 9.0, 1.5])
    iface = make_interface("rm", InterfaceSettings(RMConfig(), None))
    loss, stats = iface.loss(ValueEngine(values), _pairs())
    # scores: chosen 2.0 (token 3) and 0.5 (token 6); rejected -1.0 (token 4) and 1.5 (token 9)
    _close(loss, (_softplus(-3.0) + _softplus(1.0)) / 2, 1e-6)
    assert stats == pytest.approx(
        {"rm_loss": loss.item(), "accuracy": 0.5, "margin": (3.0 - 1.0) / 2}
    )


def test_rm_interface_train_step_steps_once_per_minibatch() -> None:
    values = torch.zeros(10, requires_grad=True)
    engine = ValueEngine(values)
    iface = make_interface("rm", InterfaceSettings(RMConfig(n_minibatches=2), None))
    iface.train_step(engine, _pairs(), CallContext(0, 0, 1, 0))
    assert engine.steps == 2
    assert values.grad is not None
    # only the final tokens get gradient: chosen ones up (negative grad), rejected ones down
    assert values.grad[3] < 0 and values.grad[6] < 0 and values.grad[4] > 0 and values.grad[9] > 0
    assert values.grad[[0, 1, 2, 5, 7, 8]].abs().sum() == 0
