"""The step: units, their order within a step and between steps (pure functions)."""

from __future__ import annotations

import pytest
from planner_support import GRAPH as PPO
from planner_support import REPO

from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.parallel.layout import Layout
from rayhf.planner.plan import Plan
from rayhf.planner.step import (
    StepOptions,
    Unit,
    carried,
    group_key,
    leading,
    pipeline,
    plan_step,
)

ALL = Layout((0, 1, 2, 3), 4)


def _ppo(**layouts: Layout) -> dict[str, Layout]:
    return {c.name: layouts.get(c.name, ALL) for c in PPO.calls}


def _homes(layouts: dict[str, Layout]) -> dict[str, Layout]:
    return Plan(layouts, "manual").home_layouts(PPO)


def waves(units: list[Unit]) -> list[list[str]]:
    """Units grouped by how many units must finish before each can start (its depth): units of
    one wave may run at the same time."""
    depth: dict[str, int] = {}
    for u in units:
        depth[u.name] = 1 + max((depth[a] for a in u.after), default=-1)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for u in units:
        out[depth[u.name]].append(u.name)
    return out


def test_calls_on_disjoint_meshes_share_a_wave_and_shared_devices_run_in_graph_order():
    layouts = _ppo(
        actor_gen=Layout((0, 1), 2), actor_train=Layout((0, 1), 2), ref_inf=Layout((2,), 1),
        critic_inf=Layout((3,), 1), critic_train=Layout((3,), 1), rew_inf=Layout((2,), 1),
    )  # fmt: skip
    units = {u.name: u for u in plan_step(PPO, layouts, _homes(layouts), StepOptions())}
    assert "critic_inf" not in units["ref_inf"].after and "ref_inf" not in units["critic_inf"].after
    assert "rew_inf" in units["ref_inf"].after or "ref_inf" in units["rew_inf"].after  # device 2
    grouped = waves(list(units.values()))
    together = next(w for w in grouped if "critic_inf" in w)
    assert "ref_inf" in together or "rew_inf" in together
    # actor_train (devices 0-1) and critic_train (device 3) both wait for the data, not each other
    assert "critic_train" not in units["actor_train"].after
    assert "actor_train" not in units["critic_train"].after
    colocated = plan_step(PPO, _ppo(), _homes(_ppo()), StepOptions())
    assert [len(w) for w in waves(colocated)] == [1] * len(PPO.calls), "one call at a time"


def test_a_lora_role_s_copies_receive_only_what_trains_and_keep_their_weights():
    gen = Layout((0, 1, 2, 3), 1, 4)
    layouts = _ppo(actor_gen=gen, critic_inf=gen)
    for adapters in (frozenset(), frozenset({"actor"})):
        by = {
            u.name: u
            for u in plan_step(PPO, layouts, _homes(layouts), StepOptions({}, adapters=adapters))
        }
        assert by["realloc:actor_gen"].skip_frozen == bool(adapters)
        assert by["actor_gen"].release != bool(adapters)
        assert not by["realloc:critic_inf"].skip_frozen and by["critic_inf"].release
    # a copy the plan releases drops its weights and is refilled whole, as any other copy
    step = StepOptions({}, adapters=frozenset({"actor"}), released=frozenset({"actor_gen"}))
    by = {u.name: u for u in plan_step(PPO, layouts, _homes(layouts), step)}
    assert not by["realloc:actor_gen"].skip_frozen and by["actor_gen"].release


def test_copies_get_weights_before_their_call_and_ema_follows_the_trained_role():
    gen = Layout((0, 1, 2, 3), 1, 4)
    layouts = _ppo(actor_gen=gen)
    homes = _homes(layouts)
    assert homes["actor"] == ALL
    units = plan_step(PPO, layouts, homes, StepOptions({"actor": [("ref", 0.1)]}))
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
    assert "ema:ref" not in [
        u.name for u in plan_step(PPO, layouts, homes, StepOptions(), evaluate=True)
    ]


def test_between_steps_a_unit_waits_for_its_devices_and_its_role_s_last_update_only():
    actor, critic = Layout((0, 1), 2), Layout((2, 3), 2)
    layouts = _ppo(
        actor_gen=actor, actor_train=actor, ref_inf=actor, rew_inf=actor, critic_inf=critic,
        critic_train=critic,
    )  # fmt: skip
    units = plan_step(PPO, layouts, _homes(layouts), StepOptions({"actor": [("ref", 0.1)]}))
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
    frozen = plan_step(PPO, layouts, _homes(layouts), StepOptions())
    assert not any(u.updates for u in frozen if u.role in ("ref", "reward"))


def _disjoint() -> dict[str, Layout]:
    """The actor generates on device 0 (a copy); everything else lives on device 1."""
    one = Layout((1,), 1)
    return {c.name: Layout((0,), 1) if c.name == "actor_gen" else one for c in PPO.calls}


def test_without_staleness_the_pipeline_is_the_step_and_its_carried_units():
    layouts = _disjoint()
    units = plan_step(PPO, layouts, _homes(layouts), StepOptions({"actor": [("ref", 0.1)]}))
    assert leading(PPO, units, 0) == frozenset()
    slots = pipeline(units, frozenset(), 0)
    before = carried(units)
    assert [s.unit.name for s in slots] == [u.name for u in units]
    for slot in slots:
        u = slot.unit
        assert slot.lead == 0
        assert slot.after == {(0, a) for a in u.after} | {(1, b) for b in before[u.name]}


def test_with_staleness_the_generation_of_step_i_plus_k_runs_before_the_training_of_step_i():
    layouts = _disjoint()
    units = plan_step(PPO, layouts, _homes(layouts), StepOptions())
    lead = leading(PPO, units, 1)
    assert lead == {"realloc:actor_gen", "actor_gen"}
    slots = {s.unit.name: s for s in pipeline(units, lead, 1)}
    assert list(slots)[:2] == ["realloc:actor_gen", "actor_gen"], "the leading units go first"
    move, gen, train = slots["realloc:actor_gen"], slots["actor_gen"], slots["actor_train"]
    assert (move.lead, gen.lead, train.lead) == (1, 1, 0)
    # the move of step p+1 waits for the actor's update one period back (step p-1), not for
    # this period's (step p): the generation samples one update behind
    assert (1, "actor_train") in move.after and (0, "actor_train") not in move.after
    assert all(lag == 1 for lag, _ in move.after)
    # the training of step p reads step p's samples, made one period back; on device 1 it
    # follows this period's move (which reads the weights it is about to change)
    assert (1, "actor_gen") in train.after
    assert train.offset(1, gen) == 0 and train.offset(0, move) == 1
    assert (0, "realloc:actor_gen") in slots["rew_inf"].after  # device 1's first rest unit


def test_frozen_roles_on_the_generation_devices_run_ahead_with_the_generation():
    gen, train = Layout((0,), 1), Layout((1,), 1)
    beside = {"actor_gen": gen, "ref_inf": gen, "rew_inf": gen}
    layouts = {c.name: beside.get(c.name, train) for c in PPO.calls}
    units = plan_step(PPO, layouts, _homes(layouts), StepOptions())
    lead = leading(PPO, units, 1)
    assert lead == {"realloc:actor_gen", "actor_gen", "ref_inf", "rew_inf"}
    slots = {s.unit.name: s for s in pipeline(units, lead, 1)}
    # step p trains on the reference and reward of step p, computed one period back: it waits
    # for nothing of this period's generation (step p+1) but the move that reads its weights
    train = slots["actor_train"]
    assert {(1, "ref_inf"), (1, "rew_inf")} <= train.after
    assert not {(0, "actor_gen"), (0, "ref_inf"), (0, "rew_inf")} & train.after
    # a role that trains (the critic) stays in its step even on the generation's device; a
    # frozen role that shares a device with training does too (it would wait for step p+1)
    layouts["critic_inf"] = gen
    assert "critic_inf" not in leading(
        PPO, plan_step(PPO, layouts, _homes(layouts), StepOptions()), 1
    )
    layouts["ref_inf"] = Layout((0, 1), 2)
    assert leading(PPO, plan_step(PPO, layouts, _homes(layouts), StepOptions()), 1) == {
        "realloc:actor_gen", "actor_gen", "rew_inf"
    }  # fmt: skip


def test_a_graph_that_generates_nothing_it_trains_cannot_run_ahead():
    dpo = load_graph(REPO / "graphs" / "dpo.yaml")
    layouts = {c.name: Layout((0,), 1) for c in dpo.calls}
    units = plan_step(dpo, layouts, Plan(layouts, "manual").home_layouts(dpo), StepOptions())
    with pytest.raises(RayhfError, match="max_staleness: 1: graph 'dpo' generates nothing"):
        leading(dpo, units, 1)
