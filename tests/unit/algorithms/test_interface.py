"""The registry and the interface base class: every algorithm registered with its config and
interfaces (each interface under its graph name), its graph file and its documentation, and a
call kind an interface lacks is an error naming the interface."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from rayhf.algorithms import judge, lm, reward
from rayhf.algorithms.grpo import GRPOConfig
from rayhf.algorithms.interface import Algorithm, CallContext, Interface, InterfaceSettings
from rayhf.config import registry
from rayhf.config.registry import ALGORITHMS, INTERFACES, interface_table, make_interface
from rayhf.envs import agent
from rayhf.sampling import GenerationConfig

REPO = Path(__file__).resolve().parents[3]


def _settings(algorithm=None) -> InterfaceSettings:
    return InterfaceSettings(algorithm, GenerationConfig())


def test_every_interface_is_registered_under_its_name_with_its_config():
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.name == name and algorithm.config.model_fields["name"].default == name
        for cls in algorithm.interfaces:
            assert INTERFACES[cls.name] is cls and issubclass(cls, Interface)
            assert cls.config_type is algorithm.config, cls.name
    for cls in registry.SHARED_INTERFACES:
        assert INTERFACES[cls.name] is cls and cls.config_type is None
    assert set(registry.SHARED_INTERFACES) == {lm.LMInterface, reward.RewardInterface,
                                               judge.JudgeInterface}  # fmt: skip
    # the multi-turn agents (rayhf.envs, a layer above) join their algorithm's row
    assert agent.GRPOAgentInterface in ALGORITHMS["grpo"].interfaces
    assert agent.PPOAgentInterface in ALGORITHMS["ppo"].interfaces
    assert registry.DEFAULT_ALGORITHM in ALGORITHMS


def test_every_algorithm_has_its_graph_example_and_documentation():
    docs = (REPO / "docs" / "algorithms.md").read_text()
    for name in ALGORITHMS:
        graph = yaml.safe_load((REPO / "graphs" / f"{name}.yaml").read_text())
        assert {c["interface"] for c in graph["calls"]} <= set(INTERFACES), name
        assert (REPO / "examples" / f"{name}_tiny.yaml").is_file(), name
        assert f"| `graphs/{name}.yaml` |" in docs, f"docs/algorithms.md has no row for {name}"


def test_an_interface_name_taken_twice_is_refused():
    class Twin(Interface):
        name = "lm"

    with pytest.raises(AssertionError, match="interface name 'lm' registered twice"):
        interface_table([Algorithm(GRPOConfig, (Twin,))])


def test_key_declarations_of_the_interfaces():
    assert Interface.balance_keys == ("seq", "prompts") and Interface.sequence_keys == ("seq",)
    assert INTERFACES["dpo"].sequence_keys == INTERFACES["rm"].sequence_keys
    assert INTERFACES["rm"].sequence_keys == ("chosen", "rejected")
    assert [n for n, c in INTERFACES.items() if c.takes_function] == ["reward"]


def test_make_interface_builds_with_the_settings():
    settings = _settings(GRPOConfig(group_size=3))
    made = make_interface("grpo_actor", settings)
    assert type(made) is INTERFACES["grpo_actor"] and made.settings is settings
    assert made.cfg.group_size == 3
    with pytest.raises(KeyError):
        make_interface("no_such_interface", settings)


@pytest.mark.parametrize("kind", ["generate", "inference", "train"])
def test_a_call_kind_the_interface_lacks_names_the_interface(kind):
    method = {"train": "train_step"}.get(kind, kind)
    iface = Interface(_settings())
    iface.name = "sft_like"
    with pytest.raises(NotImplementedError, match=f"interface 'sft_like' has no {kind} call"):
        getattr(iface, method)(None, None, CallContext(0, 0, 1, 0))


def test_base_defaults_evaluate_nothing_and_keep_no_state():
    iface = make_interface("lm", _settings())
    assert iface.evaluate(None, None, CallContext(0, 0, 1, 0)) == {}
    assert iface.state_dict() == {}
    iface.load_state_dict({"anything": 1})  # accepted and ignored


def test_call_context_is_frozen_and_args_are_not_shared():
    a, b = CallContext(1, 0, 2, 7), CallContext(1, 1, 2, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.step = 2  # type: ignore[misc]
    a.args["x"] = 1
    assert b.args == {}
