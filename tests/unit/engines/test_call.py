"""What a call's interface sees: ``CallEngine`` routes each operation to the part that owns it
and refuses one its call does not have."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

from rayhf.algorithms import interface
from rayhf.checks.common import EOS, PAD, Tok, tiny_model
from rayhf.engines.call import CallEngine, whole_state
from rayhf.engines.collectives import DataParallel
from rayhf.engines.rank_model import RankModel
from rayhf.sampling import GenerateOutput, GenerationConfig


class FakeGenerator:
    name = "fake_gen"

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def generate(self, prompts, cfg, seed) -> GenerateOutput:
        self.calls.append((prompts, cfg, seed))
        n = len(prompts)
        return GenerateOutput([[EOS]] * n, [[-0.5]] * n, [True] * n)


class FakeTrainer:
    name = "fake_train"

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.gathering = False

    def train(self, minibatches, loss_fn, *_):
        self.calls.append((minibatches, loss_fn))
        return {"loss": 1.0}

    @contextlib.contextmanager
    def gathered(self):
        self.gathering = True
        yield
        self.gathering = False


@pytest.fixture(scope="module")
def model() -> RankModel:
    return RankModel.from_hf(tiny_model("llama", {"n_heads": 4}), Tok(), False)


def test_generate_goes_to_the_call_s_generator(model):
    gen = FakeGenerator()
    engine = CallEngine(Tok(), model, DataParallel(None), generator=gen)
    cfg = GenerationConfig(max_new_tokens=3)
    out = engine.generate([[3, 4], [5]], cfg, seed=11)
    assert gen.calls == [([[3, 4], [5]], cfg, 11)]
    assert out.tokens == [[EOS], [EOS]]


def test_generate_without_a_generator_is_refused(model):
    engine = CallEngine(Tok(), model, DataParallel(None), trainer=FakeTrainer())
    with pytest.raises(AssertionError, match="generate outside a generate call"):
        engine.generate([[3]], GenerationConfig(), seed=0)


def test_train_goes_to_the_trainer_and_a_frozen_role_refuses(model):
    trainer = FakeTrainer()
    engine = CallEngine(Tok(), model, DataParallel(None), trainer=trainer)

    def loss_fn(mb):
        return torch.zeros(()), {}

    assert engine.train(["mb"], loss_fn) == {"loss": 1.0}
    assert trainer.calls == [(["mb"], loss_fn)]
    frozen = CallEngine(Tok(), model, DataParallel(None))
    with pytest.raises(AssertionError, match="train on a frozen role"):
        frozen.train(["mb"], loss_fn)


def test_forward_is_the_rank_model_s_and_a_function_role_has_none(model):
    engine = CallEngine(Tok(), model, DataParallel(None))
    ids = torch.tensor([[3, 4, 5]])
    mask = torch.ones_like(ids)
    assert torch.equal(engine.forward(ids, mask), model.forward(ids, mask))
    assert engine.value_head is False
    function_role = CallEngine(Tok(), None, DataParallel(None))
    assert function_role.value_head is False
    with pytest.raises(AssertionError, match="without a model"):
        function_role.forward(ids, mask)


def test_name_is_the_backend_that_runs_the_call(model):
    comm = DataParallel(None)
    both = CallEngine(Tok(), model, comm, FakeGenerator(), FakeTrainer())
    assert both.name == "fake_gen"
    assert CallEngine(Tok(), model, comm, trainer=FakeTrainer()).name == "fake_train"
    assert CallEngine(Tok(), model, comm).name == "torch"
    assert CallEngine(Tok(), None, comm).name == "function"


def test_ids_and_reductions_with_one_replica():
    engine = CallEngine(Tok(), None, DataParallel(None))
    assert (engine.pad_id, engine.eos_id) == (PAD, EOS)
    assert engine.all_reduce_mean({"a": 2.0}) == {"a": 2.0}
    t = torch.arange(3.0)
    assert torch.equal(engine.all_reduce_sum(t), t)
    assert engine.all_gather_object({"x": 1}) == [{"x": 1}]


def test_full_state_gathers_inside_the_trainer_and_owns_its_tensors(model, monkeypatch):
    trainer = FakeTrainer()
    seen = []
    real_full_state = model.full_state

    def full_state():
        seen.append(trainer.gathering)
        return real_full_state()

    monkeypatch.setattr(model, "full_state", full_state)
    state = CallEngine(Tok(), model, DataParallel(None), trainer=trainer).full_state()
    assert seen == [True] and not trainer.gathering
    live = model.module.local_state()["lm_head.weight"]
    assert torch.equal(state["lm_head.weight"], live)
    state["lm_head.weight"].add_(1.0)  # a copy: the model is untouched
    assert not torch.equal(state["lm_head.weight"], live)
    monkeypatch.undo()
    assert set(whole_state(model, None)) == set(state)


def test_interfaces_see_the_call_engine_itself():
    """One contract, one name: what an interface is handed is typed as ``CallEngine``."""
    assert interface.CallEngine is CallEngine
    hints = inspect.signature(interface.Interface.generate).parameters["engine"].annotation
    assert hints == "CallEngine"
