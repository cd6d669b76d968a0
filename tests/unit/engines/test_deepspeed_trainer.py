"""DeepSpeed's pure parts: what ``check_deepspeed`` refuses (and the field each error names),
the DeepSpeed config of a train call, and the errors without DeepSpeed. DeepSpeed itself is
started in tests/integration/test_deepspeed_engine.py."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import needs_deepspeed

from rayhf.checks.common import Tok, tiny_model
from rayhf.engines.config import DeepSpeedEngineConfig
from rayhf.engines.deepspeed_trainer import (
    DEEPSPEED_EXTRA,
    _FlatSlices,
    check_deepspeed,
    ds_config,
    import_deepspeed,
)
from rayhf.engines.rank_model import RankModel
from rayhf.engines.torch_trainer import OptimizerConfig
from rayhf.errors import RayhfError
from rayhf.parallel.layout import Layout

DP2 = Layout((0, 1), dp=2)
DP2_OTHER = Layout((2, 3), dp=2)
Z2, Z3 = DeepSpeedEngineConfig(), DeepSpeedEngineConfig(zero_stage=3)


@pytest.fixture
def installed(monkeypatch):
    """Pretend DeepSpeed is installed, so the checks before that one decide."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "deepspeed" else real(name),
    )


def _check(engine=Z2, layouts=None, zero1=False, init_from=None, precision="fp32"):
    layouts = layouts or {"actor_train": DP2}
    check_deepspeed("actor_train", "actor", engine, layouts, zero1, init_from, precision)


def test_fp16_is_refused_and_bf16_passes(installed):
    with pytest.raises(RayhfError, match=r"^models\.actor\.precision: fp16 .* use bf16"):
        _check(precision="fp16")
    _check(precision="bf16")


def test_a_dp_only_layout_passes(installed):
    _check()
    _check(Z3, {"actor_train": DP2, "actor_gen": DP2_OTHER})  # other calls on other ranks


@pytest.mark.parametrize("layout", [Layout((0, 1), dp=1, tp=2), Layout((0, 1), dp=1, pp=2)])
def test_tp_or_pp_is_refused(installed, layout):
    with pytest.raises(RayhfError) as info:
        _check(layouts={"actor_train": layout})
    msg = str(info.value)
    assert msg.startswith("engines.actor_train.engine: DeepSpeed ZeRO shards over data-parallel")
    assert layout.name in msg and "set plan.actor_train to a dp-only layout" in msg


def test_zero1_beside_deepspeed_is_refused(installed):
    with pytest.raises(RayhfError, match=r"^models\.actor\.optimizer\.zero1: .*remove zero1$"):
        _check(zero1=True)


def test_zero3_cannot_receive_weights(installed):
    with pytest.raises(RayhfError, match=r"^engines\.actor_train\.zero_stage: .*init_from"):
        _check(Z3, init_from="actor")
    _check(Z2, init_from="actor")  # stages 1 and 2 hold whole weights: they can


def test_zero3_ranks_are_not_shared_with_the_role_s_other_calls(installed):
    layouts = {"actor_train": DP2, "actor_gen": DP2_OTHER, "actor_inf": DP2}
    with pytest.raises(RayhfError, match=r"^plan\.actor_inf: role 'actor' trains on ZeRO-3"):
        _check(Z3, layouts)
    _check(Z2, layouts)  # stage 2 ranks hold whole weights: sharing is fine


def test_not_installed_names_the_extra(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(RayhfError) as info:
        _check()
    assert (
        str(info.value)
        == f"engines.actor_train.engine: DeepSpeed is not installed: {DEEPSPEED_EXTRA}"
    )
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails
    with pytest.raises(RayhfError, match="engine 'deepspeed' needs DeepSpeed") as info:
        import_deepspeed()
    assert DEEPSPEED_EXTRA in str(info.value)


@needs_deepspeed
def test_nothing_is_compiled_for_the_shared_memory_inference_all_reduce():
    """DeepSpeed would JIT-build it under a lock file in ~/.cache (a killed build hung CI)."""
    ops = import_deepspeed().ops
    assert ops.__compatible_ops__["deepspeed_shm_comm"] is False
    from deepspeed.comm.torch import build_shm_op

    assert build_shm_op() is None


def test_ds_config_carries_the_optimizer_settings():
    optim = OptimizerConfig(lr=3e-4, weight_decay=0.01, betas=(0.8, 0.99), eps=1e-6, grad_clip=2.0)
    cfg = ds_config(optim, 2, offload=False)
    assert cfg["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.01,
                   "torch_adam": True},
    }  # fmt: skip
    assert cfg["gradient_clipping"] == 2.0
    assert cfg["train_micro_batch_size_per_gpu"] == cfg["gradient_accumulation_steps"] == 1
    assert cfg["zero_optimization"] == {"stage": 2}
    assert "fp16" not in cfg and "bf16" not in cfg  # fp32


@pytest.mark.parametrize(
    ("stage", "zero"),
    [
        (1, {"stage": 1, "offload_optimizer": {"device": "cpu"}}),
        (2, {"stage": 2, "offload_optimizer": {"device": "cpu"}}),
        (
            3,
            {
                "stage": 3,
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            },
        ),
    ],
)
def test_offload_moves_optimizer_state_and_zero3_parameters(stage, zero):
    assert ds_config(OptimizerConfig(), stage, offload=True)["zero_optimization"] == zero


def test_a_zero3_source_sends_its_flat_slices():
    model = RankModel.from_hf(tiny_model("llama", {"n_heads": 4}), Tok(), False)
    for p in model.module.parameters():
        p.ds_tensor = p.detach().flatten()[:3]  # what ZeRO-3 leaves on a rank
    slices = _FlatSlices(model).source_shards()
    assert set(slices) == set(model.source_shards())
    name = "model.embed_tokens.weight"
    assert torch.equal(slices[name], model.source_shards()[name].detach().flatten()[:3])
