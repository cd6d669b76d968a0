from pathlib import Path

import pytest
import yaml

from rayhf.config import dump_config, load_config
from rayhf.errors import RayhfError

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"


def test_overrides_parse_yaml_values_and_nested_keys():
    cfg = load_config(EXAMPLE, ["steps=7", "algorithm.kl_coef=0.3", "generation.greedy=true"])
    assert cfg.steps == 7 and cfg.algorithm.kl_coef == 0.3 and cfg.generation.greedy is True
    cfg2 = cfg.with_overrides({"models.actor.optimizer.lr": 1e-2})
    assert cfg2.models["actor"].optimizer.lr == 1e-2 and cfg.models["actor"].optimizer.lr != 1e-2


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("algorithm.gama=1", "config field algorithm.gama: unknown key"),
        ("algorithm.kl_ctl=0.1", "config field algorithm.kl_ctl: renamed: write algorithm.kl_coef"),
        (
            "algorithm={name: grpo, kl_ctl: 0.1}",
            "config field algorithm.kl_ctl: renamed: write algorithm.kl_coef",
        ),
        ("batch_size=-3", "config field batch_size"),
        ("cluster.device=tpu", "config field cluster.device"),
        ("models.ref.path=/x", "config field models.ref"),
        ("plan=sometimes", "config field plan"),
        ("fault_tolerance.max_restarts=-1", "config field fault_tolerance.max_restarts"),
        ("fault_tolerance.inject={site: nowhere, role: actor}", "fault_tolerance.inject.0.site"),
        ("fault_tolerance.inject={site: call, role: critc}", "inject.0.role 'critc' is not a role"),
        (
            "fault_tolerance.inject=[{site: call, role: actor}, {site: eval, role: critc}]",
            "fault_tolerance.inject.1.role 'critc' is not a role",
        ),
        ("resume=always", "config field resume"),
        (
            "engines.actor_train={engine: torch, zero_stage: 3}",
            "config field engines.actor_train.zero_stage: not a setting of engine 'torch': "
            "zero_stage is a setting of engine 'deepspeed'",
        ),
        (
            "engines.actor_gen={engine: vllm, max_rows: 8}",
            "engines.actor_gen.max_rows: not a setting of engine 'vllm': max_rows is a setting "
            "of engine 'native'",
        ),
        ("engines.actor_train={engine: torch, zero: 3}", "engines.actor_train.zero: unknown key"),
        (
            "engines.actor_gen.engine=jax",
            "config field engines.actor_gen.engine: 'jax' is not an engine (one of native, vllm, "
            "torch, deepspeed)",
        ),
        ("engines.actor_gen.max_rows=8", "config field engines.actor_gen.engine: missing"),
        ("engines.actor_gen={engine: native, max_rows: 0}", "engines.actor_gen.max_rows"),
        ("algorithm.max_staleness=-1", "config field algorithm.max_staleness"),
        (
            "algorithm={name: remax, max_staleness: 1}",
            "remax has no off-policy correction; set algorithm.max_staleness: 0",
        ),
        (
            "algorithm={name: dpo, max_staleness: 2}",
            "dpo has no off-policy correction; set algorithm.max_staleness: 0",
        ),
        (
            ("algorithm.max_staleness=1", "driver.overlap_steps=false"),
            "max_staleness: 1 runs steps overlapped; set driver.overlap_steps: true",
        ),
    ],
)
def test_bad_values_name_the_field(override, needle):
    with pytest.raises(RayhfError) as err:
        load_config(EXAMPLE, [override] if isinstance(override, str) else list(override))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_resolved_config_roundtrip(tmp_path):
    cfg = load_config(EXAMPLE, ["seed=9"])
    dump_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert again == cfg
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert raw["algorithm"]["gamma"] == 1.0  # defaults are written out, not left implicit


def test_an_engine_section_keeps_only_its_own_fields_through_a_dump(tmp_path):
    engines = [
        "engines.actor_train={engine: deepspeed, zero_stage: 3}",
        "engines.actor_gen={engine: vllm, check_sync: false}",
    ]
    cfg = load_config(EXAMPLE, engines)
    dump_config(cfg, tmp_path / "config.yaml")
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert raw["engines"] == {
        "actor_train": {"engine": "deepspeed", "zero_stage": 3, "offload": False},
        "actor_gen": {"engine": "vllm", "check_sync": False, "lora_adapter": True},
    }
    assert load_config(tmp_path / "config.yaml") == cfg
    assert cfg.engine_of("critic_train", "train").engine == "torch"  # the kind's default
    assert cfg.engine_of("actor_gen", "generate").checks_sync is False


def test_override_into_a_scalar_is_refused():
    with pytest.raises(RayhfError, match=r"override steps\.x: 'steps' is not a section"):
        load_config(EXAMPLE, ["steps.x=1"])


def test_one_injected_fault_is_a_list_of_one_and_each_fires_in_its_own_attempt():
    one = load_config(EXAMPLE, ["fault_tolerance.inject={site: call, step: 2, role: actor}"])
    ft = one.fault_tolerance
    assert [f.site for f in ft.inject] == ["call"]
    assert ft.fault_of_attempt(0) == ft.inject[0] and ft.fault_of_attempt(1) is None
    two = load_config(
        EXAMPLE,
        ["fault_tolerance.inject=[{site: startup, role: actor}, {site: eval, role: critic}]"],
    ).fault_tolerance
    assert [two.fault_of_attempt(n).site for n in (0, 1)] == ["startup", "eval"]  # type: ignore[union-attr]
    assert two.fault_of_attempt(2) is None and load_config(EXAMPLE).fault_tolerance.inject == []
