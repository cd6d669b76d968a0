"""Assembling a rank's engines: a generator per generate call (one vLLM engine shared by the
calls that ask for vLLM), the trainer the train call asks for, and a standalone engine."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from rayhf.checks.common import Tok, tiny_model
from rayhf.engines import build
from rayhf.engines.config import (
    DeepSpeedEngineConfig,
    NativeEngineConfig,
    TorchEngineConfig,
    VllmEngineConfig,
)
from rayhf.engines.native import NativeGenerator
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import OptimizerConfig, TorchTrainer

NATIVE, VLLM = NativeEngineConfig(), VllmEngineConfig()


@pytest.fixture(scope="module")
def model() -> RankModel:
    return RankModel.from_hf(tiny_model("llama", {"n_heads": 4}), Tok(), False)


class FakeVllm:
    """Stands in for ``VllmGenerator`` (a real one starts vLLM)."""

    made: ClassVar[list[FakeVllm]] = []

    def __init__(self, model, seed, sleeps, checked_by, merge_adapters=False) -> None:
        self.model, self.seed, self.sleeps, self.checked_by = model, seed, sleeps, checked_by
        FakeVllm.made.append(self)


@pytest.fixture
def fake_vllm(monkeypatch) -> list[FakeVllm]:
    FakeVllm.made = []
    monkeypatch.setattr("rayhf.engines.vllm_generator.VllmGenerator", FakeVllm)
    return FakeVllm.made


def test_each_native_call_gets_its_own_generator_on_the_rank_s_model(model, fake_vllm):
    gens = build.make_generators(model, {"gen": NATIVE, "greedy_gen": NATIVE}, 0, False)
    assert list(gens) == ["gen", "greedy_gen"]
    assert all(isinstance(g, NativeGenerator) and g.model is model for g in gens.values())
    assert gens["gen"] is not gens["greedy_gen"]
    assert fake_vllm == []  # no vLLM engine unless a call asks for one


def test_vllm_calls_share_one_engine_beside_native_ones(model, fake_vllm):
    engines = {"gen": VLLM, "greedy_gen": NATIVE, "eval_gen": VLLM}
    gens = build.make_generators(model, engines, seed=5, sleeps=True)
    assert len(fake_vllm) == 1
    (vllm,) = fake_vllm
    assert (vllm.model, vllm.seed, vllm.sleeps) == (model, 5, True)
    assert vllm.checked_by == ("gen", "eval_gen")  # check_sync is on by default
    assert gens["gen"] is vllm and gens["eval_gen"] is vllm
    assert isinstance(gens["greedy_gen"], NativeGenerator)
    assert build.make_generators(model, {}, 0, False) == {}


def test_the_shared_vllm_engine_checks_its_syncs_when_any_of_its_calls_asks(model, fake_vllm):
    unchecked = VllmEngineConfig(check_sync=False)
    build.make_generators(model, {"gen": VLLM, "eval_gen": unchecked, "g": NATIVE}, 0, False)
    build.make_generators(model, {"gen": unchecked, "eval_gen": unchecked}, 0, False)
    assert [v.checked_by for v in fake_vllm] == [("gen",), ()]


def test_make_trainer_follows_the_train_call_s_engine(model, monkeypatch):
    optim = OptimizerConfig(lr=1e-3)
    trainer = build.make_trainer(model, optim, TorchEngineConfig())
    assert isinstance(trainer, TorchTrainer) and trainer.cfg is optim
    made = []
    monkeypatch.setattr(
        "rayhf.engines.deepspeed_trainer.DeepSpeedTrainer", lambda *a: made.append(a) or "ds"
    )
    ds = DeepSpeedEngineConfig(zero_stage=3)
    assert build.make_trainer(model, optim, ds) == "ds"
    assert made == [(model, optim, ds)]


def test_standalone_engine_with_and_without_an_optimizer():
    hf = tiny_model("llama", {"n_heads": 4})
    frozen = build.standalone_engine(hf, Tok(), value_head=False)
    assert frozen.trainer is None and isinstance(frozen.generator, NativeGenerator)
    assert frozen.generator.model is frozen.model and frozen.comm.group is None
    assert frozen.name == "native"
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        expected = hf(ids).logits
    torch.testing.assert_close(frozen.forward(ids, torch.ones_like(ids)), expected)
    trainable = build.standalone_engine(hf, Tok(), False, OptimizerConfig(), n_microbatches=2)
    assert isinstance(trainable.trainer, TorchTrainer)
    assert trainable.trainer.model is trainable.model and trainable.model.pipe.n_microbatches == 2
