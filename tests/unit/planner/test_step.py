"""The step: units, their order within a step and between steps (pure functions)."""

from __future__ import annotations

from planner_support import GRAPH as PPO

from rayhf.parallel.layout import Layout
from rayhf.planner.plan import Plan
from rayhf.planner.step import carried, group_key, plan_step, waves

ALL = Layout((0, 1, 2, 3), 4)


def _ppo(**layouts: Layout) -> dict[str, Layout]:
    return {c.name: layouts.get(c.name, ALL) for c in PPO.calls}


def _homes(layouts: dict[str, Layout]) -> dict[str, Layout]:
    return Plan(layouts, "manual").home_layouts(PPO)


def test_calls_on_disjoint_meshes_share_a_wave_and_shared_devices_run_in_graph_order():
    layouts = _ppo(
        actor_gen=Layout((0, 1), 2), actor_train=Layout((0, 1), 2), ref_inf=Layout((2,), 1),
        critic_inf=Layout((3,), 1), critic_train=Layout((3,), 1), rew_inf=Layout((2,), 1),
    )  # fmt: skip
    units = {u.name: u for u in plan_step(PPO, layouts, _homes(layouts), {})}
    assert "critic_inf" not in units["ref_inf"].after and "ref_inf" not in units["critic_inf"].after
    assert "rew_inf" in units["ref_inf"].after or "ref_inf" in units["rew_inf"].after  # device 2
    grouped = waves(list(units.values()))
    together = next(w for w in grouped if "critic_inf" in w)
    assert "ref_inf" in together or "rew_inf" in together
    # actor_train (devices 0-1) and critic_train (device 3) both wait for the data, not each other
    assert "critic_train" not in units["actor_train"].after
    assert "actor_train" not in units["critic_train"].after
    colocated = plan_step(PPO, _ppo(), _homes(_ppo()), {})
    assert [len(w) for w in waves(colocated)] == [1] * len(PPO.calls), "one call at a time"


def test_copies_get_weights_before_their_call_and_ema_follows_the_trained_role():
    gen = Layout((0, 1, 2, 3), 1, 4)
    layouts = _ppo(actor_gen=gen)
    homes = _homes(layouts)
    assert homes["actor"] == ALL
    units = plan_step(PPO, layouts, homes, {"actor": [("ref", 0.1)]})
    names = [u.name for u in units]
    by = {u.name: u for u in units}
    assert names.index("realloc:actor_gen") == names.index("actor_gen") - 1
    move = by["realloc:actor_gen"]
    assert move.groups == (group_key("actor", ALL), group_key("actor", gen))
    assert "realloc:actor_gen" in by["actor_gen"].after and by["actor_gen"].release
    # on-policy: the actor trains after every earlier unit of its role; the ref blends after
    # it was read (ref_inf) and after the actor trained
    assert {"realloc:actor_gen", "actor_gen"} <= by["actor_train"].after
    assert {"actor_train", "ref_inf"} <= by["ema:ref"].after and by["ema:ref"].eta == 0.1
    assert "ema:ref" not in [u.name for u in plan_step(PPO, layouts, homes, {}, evaluate=True)]


def test_between_steps_a_unit_waits_for_its_devices_and_its_role_s_last_update_only():
    actor, critic = Layout((0, 1), 2), Layout((2, 3), 2)
    layouts = _ppo(
        actor_gen=actor, actor_train=actor, ref_inf=actor, rew_inf=actor, critic_inf=critic,
        critic_train=critic,
    )  # fmt: skip
    units = plan_step(PPO, layouts, _homes(layouts), {"actor": [("ref", 0.1)]})
    before = carried(units)
    # the actor generates again once it trained and its devices' last unit (the blend) is done;
    # the critic may still be training
    assert before["actor_gen"] == {"ema:ref", "actor_train"}
    assert "critic_train" not in before["actor_gen"]
    # the critic's first unit of the next step waits for its training; the ref for its blend
    assert before["critic_inf"] == {"critic_train"}
    assert "ema:ref" in before["ref_inf"]
    # a role nobody trains or blends is no barrier: the reward waits for its devices only
    assert all(not u.startswith(("critic", "actor_train")) for u in before["rew_inf"])
    frozen = plan_step(PPO, layouts, _homes(layouts), {})
    assert not any(u.updates for u in frozen if u.role in ("ref", "reward"))
