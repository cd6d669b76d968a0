"""SFT: the cross-entropy loss against hand-worked numbers and torch's cross entropy; the ``sft``
interface on a fake engine."""

import pydantic
import pytest
import torch
import torch.nn.functional as F
from algo_support import LENGTHS, LN, ScoresFromForward, T, _close, _mask

from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.algorithms.lm import token_logprobs
from rayhf.algorithms.sft import SFTConfig, sft_loss
from rayhf.config.registry import make_interface
from rayhf.data.batch import PackedBatch

# ----- config -------------------------------------------------------------------------------


def test_config_defaults_and_bad_values() -> None:
    assert SFTConfig().n_minibatches == 1
    assert all(f.description for f in SFTConfig.model_fields.values())  # attribute docstrings
    for bad in ({"n_minibatches": 0}, {"no_such_field": 1}):
        with pytest.raises(pydantic.ValidationError):
            SFTConfig(**bad)


# ----- SFT ----------------------------------------------------------------------------------


def _logp(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return token_logprobs(logits, labels.masked_fill(~mask, 0))


def test_sft_loss_by_hand() -> None:
    # logits [0, 0, ln 2] -> probs [1/4, 1/4, 1/2]: nll ln 2 and ln 4, mean 1.5 ln 2
    logits = torch.tensor([[[0.0, 0.0, LN(2.0)]] * 3, [[9.0, 0.0, 0.0]] * 3])
    labels = torch.tensor([[2, 0, -100], [-100, -100, -100]])
    mask = _mask([2, 0], 3)
    loss, stats = sft_loss(_logp(logits, labels, mask), mask)
    _close(loss, 1.5 * LN(2.0), 1e-6)
    assert stats["nll"] == pytest.approx(1.5 * LN(2.0))


def test_sft_loss_equals_torch_cross_entropy() -> None:
    g = torch.Generator().manual_seed(53)
    logits = torch.randn(len(LENGTHS), T, 11, generator=g, requires_grad=True)
    mask = _mask(LENGTHS)
    labels = torch.randint(0, 11, (len(LENGTHS), T), generator=g).masked_fill(~mask, -100)
    loss, stats = sft_loss(_logp(logits, labels, mask), mask)
    expected = F.cross_entropy(logits[mask], labels[mask])
    _close(loss, expected, 1e-6)
    _close(loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), 1e-6)
    assert stats["nll"] == pytest.approx(expected.item(), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    _close(grad, expected_grad, 1e-6)
    empty, _ = sft_loss(_logp(logits, labels, mask), torch.zeros_like(mask))
    assert empty.item() == 0.0


# ----- the sft interface --------------------------------------------------------------------


class BigramEngine(ScoresFromForward):
    """A model whose logits at a position are ``table[its token]``."""

    pad_id = 0

    def __init__(self, table: torch.Tensor) -> None:
        self.table, self.minibatches = table, []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.table[input_ids]

    def train(self, minibatches, loss_fn):
        self.minibatches = list(minibatches)
        return loss_fn(minibatches[0])[1]


def _demos() -> PackedBatch:
    """Prompt [2, 3] + response [4, 5]; prompt [6] + response [7]; prompt [8, 9], no response."""
    b = PackedBatch([0, 1, 2])
    b.add("seq", torch.tensor([2, 3, 4, 5, 6, 7, 8, 9]), [4, 2, 2])
    b.add("prompt_lens", torch.tensor([2, 1, 2]), [1, 1, 1])
    return b


def test_sft_interface_is_cross_entropy_on_response_tokens_only() -> None:
    table = torch.randn(12, 12, generator=torch.Generator().manual_seed(54))
    iface = make_interface("sft", InterfaceSettings(SFTConfig(), None))
    loss, stats = iface.loss(BigramEngine(table), _demos())
    # predictions of 4 (after 3), 5 (after 4) and 7 (after 6); never of a prompt token
    expected = F.cross_entropy(table[[3, 4, 6]], torch.tensor([4, 5, 7]))
    _close(loss, expected, 1e-6)
    assert stats["nll"] == pytest.approx(expected.item(), rel=1e-6)


def test_sft_interface_train_step_splits_into_its_minibatches() -> None:
    engine = BigramEngine(torch.zeros(12, 12))
    iface = make_interface("sft", InterfaceSettings(SFTConfig(n_minibatches=3), None))
    iface.train_step(engine, _demos(), CallContext(0, 0, 1, 0))
    assert sorted(i for mb in engine.minibatches for i in mb.sample_ids) == [0, 1, 2]
    assert [mb.n_samples for mb in engine.minibatches] == [1, 1, 1]
