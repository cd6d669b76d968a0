"""The offline interfaces' shared base: a preference side viewed as ``seq``, train as minibatched
steps, and evaluate as a sample-weighted mean over every dp rank without an update."""

import pytest
import torch

from rayhf.algorithms.dpo import DPOConfig
from rayhf.algorithms.interface import CallContext, InterfaceSettings
from rayhf.algorithms.offline import OfflineInterface, as_seq
from rayhf.data.batch import PackedBatch

CTX = CallContext(0, 0, 1, 0)


def _pairs(n: int) -> PackedBatch:
    """Sample i: prompt [i], chosen = prompt + [10 + i], rejected = prompt + [20 + i, 30 + i]."""
    b = PackedBatch(list(range(100, 100 + n)))
    b.add("chosen", torch.tensor([t for i in range(n) for t in (i, 10 + i)]), [2] * n)
    b.add("rejected", torch.tensor([t for i in range(n) for t in (i, 20 + i, 30 + i)]), [3] * n)
    b.add("prompt_lens", torch.ones(n, dtype=torch.long), [1] * n)
    return b


class SeqLength(OfflineInterface):
    """Loss = mean ``seq`` length of the minibatch; records whether grad was on."""

    def __init__(self, n_minibatches: int = 1) -> None:
        super().__init__(InterfaceSettings(DPOConfig(n_minibatches=n_minibatches), None))
        self.grad_enabled: list[bool] = []

    def loss(self, engine, mb):
        self.grad_enabled.append(torch.is_grad_enabled())
        value = float(sum(mb.seqlens["seq"])) / mb.n_samples
        return torch.tensor(value), {"len": value, "n": float(mb.n_samples)}


class FakeEngine:
    """Trains by calling ``loss_fn`` per minibatch; gathers this rank's object after ``others``."""

    def __init__(self, others: list[object] = ()) -> None:
        self.others, self.minibatches = list(others), []

    def train(self, minibatches, loss_fn):
        self.minibatches = list(minibatches)
        return {"steps": float(len([loss_fn(mb) for mb in minibatches]))}

    def all_gather_object(self, obj):
        return [*self.others, obj]


def test_as_seq_views_one_side_of_each_pair():
    batch = _pairs(2)
    view = as_seq(batch, "rejected")
    assert view.sample_ids == batch.sample_ids and view.keys() == ["seq", "prompt_lens"]
    assert view.sample("seq", 1).tolist() == [1, 21, 31]
    assert view.tensors["prompt_lens"] is batch.tensors["prompt_lens"]
    assert as_seq(batch, "chosen").seqlens["seq"] == [2, 2]


def test_train_step_takes_one_step_per_configured_minibatch():
    iface, engine = SeqLength(n_minibatches=2), FakeEngine()
    batch = _pairs(5)
    batch.add("seq", batch.tensors["chosen"], batch.seqlens["chosen"])
    assert iface.train_step(engine, batch, CTX) == {"steps": 2.0}
    assert sorted(mb.n_samples for mb in engine.minibatches) == [2, 3]
    ids = sorted(i for mb in engine.minibatches for i in mb.sample_ids)
    assert ids == batch.sample_ids
    assert iface.grad_enabled == [True, True]


def test_evaluate_weights_each_rank_by_its_samples_and_needs_no_grad():
    iface = SeqLength()
    batch = as_seq(_pairs(3), "rejected")  # this rank: len 3 over 3 samples
    other = ({"len": 2.0 * 1, "n": 1.0 * 1}, 1)  # another rank: len 2 over 1 sample
    stats = iface.evaluate(FakeEngine([other]), batch, CTX)
    assert stats == pytest.approx({"len": (3 * 3 + 2) / 4, "n": (3 * 3 + 1) / 4})
    assert iface.grad_enabled == [False]


def test_evaluate_on_an_empty_rank_still_joins_the_gather():
    iface = SeqLength()
    empty = as_seq(_pairs(0), "chosen")
    other = ({"len": 2.0 * 4}, 4)
    assert iface.evaluate(FakeEngine([other]), empty, CTX) == pytest.approx({"len": 2.0})
    assert iface.grad_enabled == []  # no forward on no samples
    assert iface.evaluate(FakeEngine(), empty, CTX) == {}  # nobody had samples
