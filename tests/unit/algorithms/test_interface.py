"""The interface registry and base class: every algorithm registered under its graph name, and
a call kind an interface lacks is an error naming the interface."""

import dataclasses

import pytest

import rayhf.algorithms  # importing registers every interface
import rayhf.envs.agent  # noqa: F401  (and the multi-turn one)
from rayhf.algorithms import interface as iface_mod
from rayhf.algorithms.dapo import DAPOConfig
from rayhf.algorithms.dpo import DPOConfig
from rayhf.algorithms.grpo import GRPOConfig
from rayhf.algorithms.gspo import GSPOConfig
from rayhf.algorithms.interface import (
    INTERFACES,
    CallContext,
    Interface,
    InterfaceSettings,
    make_interface,
    register,
)
from rayhf.algorithms.ppo import PPOConfig
from rayhf.algorithms.reinforce_pp import ReinforcePPConfig
from rayhf.algorithms.remax import ReMaxConfig
from rayhf.algorithms.rloo import RLOOConfig
from rayhf.algorithms.rm import RMConfig
from rayhf.algorithms.sft import SFTConfig
from rayhf.sampling import GenerationConfig

CONFIG_OF = {
    "lm": None,
    "reward": None,
    "judge": None,
    "ppo_actor": PPOConfig,
    "ppo_critic": PPOConfig,
    "grpo_actor": GRPOConfig,
    "grpo_agent": GRPOConfig,  # rayhf.envs.agent, registered on importing rayhf.runtime
    "rloo_actor": RLOOConfig,
    "gspo_actor": GSPOConfig,
    "dapo_actor": DAPOConfig,
    "reinforce_pp_actor": ReinforcePPConfig,
    "ppo_agent": PPOConfig,
    "remax_actor": ReMaxConfig,
    "dpo": DPOConfig,
    "rm": RMConfig,
    "sft": SFTConfig,
}


def _settings(algorithm=None) -> InterfaceSettings:
    return InterfaceSettings(algorithm, GenerationConfig())


def test_every_interface_is_registered_under_its_name_with_its_config():
    assert set(INTERFACES) == set(CONFIG_OF)
    for name, cls in INTERFACES.items():
        assert cls.name == name and issubclass(cls, Interface)
        assert cls.config_type is CONFIG_OF[name], name


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


def test_register_names_the_class_and_adds_it(monkeypatch):
    registry: dict = {}
    monkeypatch.setattr(iface_mod, "INTERFACES", registry)

    @register("echo")
    class Echo(Interface):
        pass

    assert Echo.name == "echo" and registry == {"echo": Echo}
    assert isinstance(iface_mod.make_interface("echo", _settings()), Echo)


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
