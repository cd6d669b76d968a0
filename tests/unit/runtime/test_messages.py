"""The messages between the driver and the role-group actors (``rayhf.runtime.messages``): each
crosses a process boundary, so each pickles to an equal value, and the constant ones are frozen."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from rayhf.algorithms import InterfaceSettings
from rayhf.algorithms.ppo import PPOConfig
from rayhf.checks.common import tiny_model
from rayhf.data.batch import PackedBatch
from rayhf.engines.config import NativeEngineConfig, TorchEngineConfig
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.models.hf import model_files
from rayhf.realloc.plan import Transfer
from rayhf.runtime.messages import (
    CallNode,
    CallRequest,
    CallResult,
    CallSpec,
    MoveNode,
    MoveResult,
    StepInput,
    WeightsSummary,
    WorkerSpec,
)
from rayhf.sampling import GenerationConfig

CALL = CallSpec(
    "actor_gen", "generate", "ppo_actor", {"n_samples": 2}, {"prompts": "prompts"},
    {"seq": "seq"}, NativeEngineConfig(),
)  # fmt: skip
SPEC = WorkerSpec(
    role="actor", layout_name="d0-1.dp2tp1pp1", rank=1, dp_size=2, tp_size=1, pp_size=1,
    n_microbatches=1, calls=(CALL,), settings=InterfaceSettings(PPOConfig(), GenerationConfig()),
    tokenizer_dir="/run/tokenizer", special_ids={"pad_token_id": 0, "eos_token_id": 2},
    model=model_files(tiny_model("llama", {"n_heads": 4}).config, False), model_dir=None,
    value_head=False, optimizer=OptimizerConfig(lr=1e-3), seed=1, threads=2,
)  # fmt: skip
TRANSFER = Transfer("w", 0, 0, 4, 0, 1, 0, 0, 64, cross=(0, 2))


def _round_trip(message):
    return pickle.loads(pickle.dumps(message))


@pytest.mark.parametrize(
    "message",
    [
        CALL,
        SPEC,
        CallNode("ref_inf", ("actor_gen",), evaluate=True, release=True),
        MoveNode("realloc:actor_gen", "actor.a+actor.b", {2: [TRANSFER]}, eta=0.5),
        MoveResult("ema:ref", 0, 64, 1.0, 2.0),
        WeightsSummary(64, 3.5),
    ],
    ids=lambda m: type(m).__name__,
)
def test_constant_messages_pickle_to_equal_values(message) -> None:
    assert _round_trip(message) == message


def test_batches_travel_inside_requests_and_results() -> None:
    batch = PackedBatch([3, 4], {"seq": torch.arange(5)}, {"seq": [2, 3]})
    for message in (
        CallRequest("actor_gen", 7, batch),
        CallResult("actor_gen", 1, batch, {"loss": 0.5}, 0.25, "native", 1.0, 2.0),
        StepInput(7, batch),
    ):
        back = _round_trip(message)
        assert type(back) is type(message)
        assert back.batch.sample_ids == [3, 4] and back.batch.seqlens == {"seq": [2, 3]}
        assert torch.equal(back.batch.tensors["seq"], batch.tensors["seq"])


def test_defaults_and_what_may_change_after_creation() -> None:
    call = CallSpec("critic_train", "train", "ppo_critic")
    assert call.engine == TorchEngineConfig() and call.args == call.inputs == {}
    assert SPEC.device == "cpu"
    assert not CallRequest("c", 0, PackedBatch([])).evaluate
    node = CallNode("c", ())
    assert not node.evaluate and not node.release and MoveNode("u", "g", {}).eta is None
    for frozen in (call, SPEC, node, StepInput(0, PackedBatch([]))):
        with pytest.raises(dataclasses.FrozenInstanceError):
            frozen.call = "other"  # type: ignore[misc]
    result = CallResult("c", 0, None, {}, 0.0)
    result.began, result.ended = 1.0, 2.0  # the worker stamps its wall clock on the result
    assert (result.engine, result.began, result.ended) == ("", 1.0, 2.0)
