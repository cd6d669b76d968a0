"""The engine registry: one config class per engine chosen by ``engine``, each with only its own
fields, the defaults per call kind, the traits the planner and runtime read, and the error for
an engine that cannot run a kind of call."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from rayhf.engines.config import (
    ENGINES,
    DeepSpeedEngineConfig,
    EngineConfig,
    EngineSite,
    NativeEngineConfig,
    TorchEngineConfig,
    VllmEngineConfig,
    check_kind,
    default_engine,
    engines_for,
    owner_of,
)
from rayhf.errors import RayhfError
from rayhf.parallel.layout import Layout

UNION = TypeAdapter(EngineConfig)


def test_defaults_per_kind_are_the_plain_engines():
    assert default_engine("generate") == NativeEngineConfig()
    assert default_engine("inference") == TorchEngineConfig()
    assert default_engine("train") == TorchEngineConfig()
    with pytest.raises(KeyError):
        default_engine("evaluate")
    assert engines_for("generate") == ("native", "vllm")
    assert engines_for("train") == ("torch", "deepspeed")
    assert engines_for("inference") == ("torch",)


def test_every_row_is_chosen_by_its_name_and_has_its_own_fields_only():
    for name, cls in ENGINES.items():
        cfg = UNION.validate_python({"engine": name})
        assert type(cfg) is cls and cfg.engine == name
        # every field says what it does (the configuration reference reads them)
        assert all(f.description for f in cls.model_fields.values()), name
        assert UNION.validate_python(cfg.model_dump()) == cfg  # a dump validates back
        for kind in cls.kinds:
            check_kind("c", kind, cfg)
    owned = [f for cls in ENGINES.values() for f in cls.model_fields if f != "engine"]
    shared = {"offload"}  # the optimizer in host memory: torch's and DeepSpeed's, one meaning
    assert len(owned) == len(set(owned)) + len(shared), "a field belongs to one engine"


def test_another_engine_s_field_is_refused_by_name():
    ds = UNION.validate_python({"engine": "deepspeed", "zero_stage": 3, "offload": True})
    assert ds == DeepSpeedEngineConfig(zero_stage=3, offload=True)
    assert DeepSpeedEngineConfig().zero_stage == 2
    for engine in ("native", "vllm", "torch"):
        for extra in ({"zero_stage": 1}, {"offload": True}):
            if engine == "torch" and "offload" in extra:
                continue  # its own too
            with pytest.raises(ValidationError, match=f"{engine}.{next(iter(extra))}\n.*Extra"):
                UNION.validate_python({"engine": engine, **extra})
    with pytest.raises(ValidationError, match="max_tokens_per_microbatch"):
        UNION.validate_python({"engine": "vllm", "max_tokens_per_microbatch": 64})
    assert owner_of("zero_stage") == "deepspeed" and owner_of("check_sync") == "vllm"
    assert owner_of("max_rows") == "native" and owner_of("nope") is None
    assert owner_of("offload") == "torch' or 'deepspeed"  # quoted by the message around it


def test_check_sync_is_a_vllm_setting_on_by_default():
    assert VllmEngineConfig().check_sync and VllmEngineConfig().checks_sync
    assert not VllmEngineConfig(check_sync=False).checks_sync
    assert not any(cls().checks_sync for cls in (NativeEngineConfig, TorchEngineConfig))


def test_the_decode_engine_settings_belong_to_the_native_engine():
    native = NativeEngineConfig(max_rows=8, cuda_graphs=False, release_memory=True)
    assert UNION.validate_python(native.model_dump()) == native
    with pytest.raises(ValidationError, match="max_rows"):
        NativeEngineConfig(max_rows=0)


@pytest.mark.parametrize(
    "bad",
    [{"engine": "jax"}, {"engine": "deepspeed", "zero_stage": 0}, {"engine": "torch", "x": 1}, {}],
)
def test_bad_values_are_refused(bad):
    with pytest.raises(ValidationError):
        UNION.validate_python(bad)


def test_configs_are_frozen_values():
    cfg = VllmEngineConfig()
    with pytest.raises(ValidationError):
        cfg.check_sync = False  # type: ignore[misc]
    assert hash(cfg) == hash(VllmEngineConfig())


def test_traits():
    native, vllm, torch, ds = (
        NativeEngineConfig(),
        VllmEngineConfig(),
        TorchEngineConfig(),
        (DeepSpeedEngineConfig(offload=True)),
    )
    assert [e.whole_model_ranks for e in (native, vllm, torch, ds)] == [False, True, False, True]
    assert [e.server_resident for e in (native, vllm, torch, ds)] == [False, True, False, False]
    assert [e.trains_in_compute_dtype for e in (torch, ds)] == [False, True]
    assert [e.offloads_optimizer for e in (torch, ds)] == [False, True]
    assert TorchEngineConfig(offload=True).offloads_optimizer
    assert [TorchEngineConfig(offload=True).offers_stage(s) for s in (0, 1, 2)] == [1, 0, 1]
    assert TorchEngineConfig(offload=True).at_zero_stage(2) == DeepSpeedEngineConfig(offload=True)
    assert TorchEngineConfig(max_tokens_per_microbatch=64).token_budget == 64
    assert ds.token_budget is None and torch.token_budget is None
    assert torch.at_zero_stage(1) is torch and torch.at_zero_stage(3) == DeepSpeedEngineConfig(
        zero_stage=3
    )
    assert ds.at_zero_stage(1) is ds
    assert (torch.zero_choices, ds.zero_choices, vllm.zero_choices) == ((0, 1, 2, 3), (1, 2, 3), ())


@pytest.mark.parametrize(
    ("engine", "zero1", "stage"),
    [
        (TorchEngineConfig(), False, 0),
        (TorchEngineConfig(), True, 1),
        (DeepSpeedEngineConfig(zero_stage=3), False, 3),
        (DeepSpeedEngineConfig(zero_stage=1), True, 1),  # its own stage, zero1 or not
        (NativeEngineConfig(), True, 0),
        (VllmEngineConfig(), True, 0),
    ],
)
def test_zero_stage_for(engine, zero1, stage):
    assert engine.zero_stage_for(zero1) == stage


def test_check_kind_names_the_field_and_the_choices():
    with pytest.raises(RayhfError) as info:
        check_kind("actor_gen", "generate", TorchEngineConfig())
    assert str(info.value) == (
        "engines.actor_gen.engine: a generate call runs on native, vllm, not 'torch'"
    )
    with pytest.raises(
        RayhfError, match=r"^engines\.train\.engine: .*torch, deepspeed, not 'vllm'"
    ):
        check_kind("train", "train", VllmEngineConfig())
    with pytest.raises(RayhfError, match=r"inference call runs on torch, not 'deepspeed'$"):
        check_kind("ref_inf", "inference", DeepSpeedEngineConfig())


def test_an_engine_runs_only_its_own_kinds():
    with pytest.raises(AssertionError, match="runs no train call"):
        NativeEngineConfig().make_trainer(None, None)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="runs no generate call"):
        TorchEngineConfig().make_generator(None, 0, False, ())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "zero1", "precision", "says"),
    [
        ("inference", False, "fp32", "engines.c.offload: c is an inference call, and only train"),
        ("train", True, "bf16", "engines.c.offload: .*models.actor.optimizer.zero1 shards it"),
        ("train", False, "fp16", "engines.c.offload: fp16's loss scaling .*models.actor.precision"),
    ],
)
def test_an_offloaded_optimizer_is_refused_where_it_cannot_run(kind, zero1, precision, says):
    site = EngineSite("c", "actor", {"c": Layout((0,), 1)}, 16, "cpu", zero1, None, precision, kind)
    with pytest.raises(RayhfError, match=says):
        TorchEngineConfig(offload=True).check(site)
    TorchEngineConfig().check(site)  # without offload: nothing to refuse
    TorchEngineConfig(offload=True).check(
        EngineSite("c", "actor", {"c": Layout((0,), 1)}, 16, "cpu", False, None, "bf16", "train")
    )
