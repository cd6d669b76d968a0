"""Which backend runs a call: ``EngineConfig`` validation, defaults per call kind, the ZeRO stage
a trainer shards with, and the error for an engine that cannot run a kind of call."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rayhf.engines.config import ENGINES_BY_KIND, EngineConfig, check_kind
from rayhf.errors import RayhfError


def test_defaults_per_kind_are_the_plain_engines():
    assert EngineConfig.default("generate") == EngineConfig(engine="native")
    assert EngineConfig.default("inference") == EngineConfig(engine="torch")
    assert EngineConfig.default("train") == EngineConfig(engine="torch")
    with pytest.raises(KeyError):
        EngineConfig.default("evaluate")


def test_deepspeed_settings_belong_to_deepspeed_only():
    ds = EngineConfig(engine="deepspeed", zero_stage=3, offload=True)
    assert (ds.zero_stage, ds.offload) == (3, True)
    assert EngineConfig(engine="deepspeed").zero_stage == 2
    for engine in ("native", "vllm", "torch"):
        for extra in ({"zero_stage": 1}, {"offload": True}):
            with pytest.raises(ValidationError, match="settings of engine 'deepspeed'"):
                EngineConfig(engine=engine, **extra)
    # a dump holds every field at its default; validated again (with_overrides), it is the same
    torch = EngineConfig(engine="torch", max_tokens_per_microbatch=64)
    assert EngineConfig.model_validate(torch.model_dump()) == torch
    with pytest.raises(ValidationError, match="max_tokens_per_microbatch is a setting of engine"):
        EngineConfig(engine="vllm", max_tokens_per_microbatch=64)


def test_check_sync_is_a_vllm_setting_on_by_default():
    assert EngineConfig(engine="vllm").check_sync
    assert not EngineConfig(engine="vllm", check_sync=False).check_sync
    for engine in ("native", "torch", "deepspeed"):
        with pytest.raises(ValidationError, match="check_sync is a setting of engine 'vllm'"):
            EngineConfig(engine=engine, check_sync=False)
        # compared by value: a dump holds the default, and validates again as the same config
        cfg = EngineConfig(engine=engine)
        assert EngineConfig.model_validate(cfg.model_dump()) == cfg


def test_the_decode_engine_settings_belong_to_the_native_engine():
    native = EngineConfig(engine="native", max_rows=8, cuda_graphs=False, release_memory=True)
    assert EngineConfig.model_validate(native.model_dump()) == native
    for field, value in (("max_rows", 8), ("cuda_graphs", False), ("compile", True)):
        for engine in ("vllm", "torch", "deepspeed"):
            with pytest.raises(ValidationError, match=f"{field} is a setting of engine 'native'"):
                EngineConfig(engine=engine, **{field: value})
    with pytest.raises(ValidationError, match="max_rows"):
        EngineConfig(engine="native", max_rows=0)


@pytest.mark.parametrize(
    "bad",
    [{"engine": "jax"}, {"engine": "deepspeed", "zero_stage": 0}, {"engine": "torch", "x": 1}],
)
def test_bad_values_are_refused(bad):
    with pytest.raises(ValidationError):
        EngineConfig(**bad)


def test_configs_are_frozen_values():
    cfg = EngineConfig(engine="vllm")
    with pytest.raises(ValidationError):
        cfg.engine = "native"  # type: ignore[misc]
    assert hash(cfg) == hash(EngineConfig(engine="vllm"))


def test_whole_model_ranks():
    assert EngineConfig(engine="vllm").whole_model_ranks
    assert EngineConfig(engine="deepspeed").whole_model_ranks
    assert not EngineConfig(engine="native").whole_model_ranks
    assert not EngineConfig(engine="torch").whole_model_ranks


@pytest.mark.parametrize(
    ("engine", "zero1", "stage"),
    [
        ({"engine": "torch"}, False, 0),
        ({"engine": "torch"}, True, 1),
        ({"engine": "deepspeed", "zero_stage": 3}, False, 3),
        ({"engine": "deepspeed", "zero_stage": 1}, True, 1),  # its own stage, zero1 or not
        ({"engine": "native"}, True, 0),
        ({"engine": "vllm"}, True, 0),
    ],
)
def test_zero_stage_for(engine, zero1, stage):
    assert EngineConfig(**engine).zero_stage_for(zero1) == stage


def test_check_kind_accepts_every_listed_engine():
    for kind, engines in ENGINES_BY_KIND.items():
        for engine in engines:
            check_kind("some_call", kind, EngineConfig(engine=engine))


def test_check_kind_names_the_field_and_the_choices():
    with pytest.raises(RayhfError) as info:
        check_kind("actor_gen", "generate", EngineConfig(engine="torch"))
    assert str(info.value) == (
        "engines.actor_gen.engine: a generate call runs on native, vllm, not 'torch'"
    )
    with pytest.raises(
        RayhfError, match=r"^engines\.train\.engine: .*torch, deepspeed, not 'vllm'"
    ):
        check_kind("train", "train", EngineConfig(engine="vllm"))
    with pytest.raises(RayhfError, match=r"inference call runs on torch, not 'deepspeed'$"):
        check_kind("ref_inf", "inference", EngineConfig(engine="deepspeed"))
