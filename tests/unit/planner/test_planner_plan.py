"""Plans (``rayhf.planner.plan``): home layouts and the reallocations they imply, manual plans
from the config, the JSON a run keeps, and the tables ``rayhf plan`` prints."""

from __future__ import annotations

import dataclasses

import pytest
from planner_support import GRAPH, REPO

from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.layout import LayoutSpec
from rayhf.planner.plan import (
    Plan,
    check_plan_fits,
    colocated_plan,
    format_plan,
    format_reallocations,
    make_plan,
    plan_from_json,
)
from rayhf.realloc.plan import plan_realloc


def _spec(family: str, **kw):
    shape = {"n_heads": 4, "n_kv_heads": 2} if family == "llama" else {"n_heads": 4}
    init = ModelInit(family=family, n_layers=4, **{"hidden_size": 32, **shape, **kw})
    return model_spec(hf_config(init, 37, 0, 2, 1), value_head=False)


def test_plan_lists_the_reallocations_it_implies():
    graph = load_graph(REPO / "graphs" / "ppo.yaml")
    specs = {r: _spec("llama") for r in ("actor", "ref", "critic")}
    entries = {c.name: LayoutSpec(dp=2) for c in graph.calls}
    entries["actor_train"] = LayoutSpec(tp=2)
    plan = make_plan(graph, entries, ClusterConfig(n_devices=2))
    assert plan.home_layouts(graph)["actor"].tp == 2
    moves = plan.reallocations(graph)
    assert [m[0] for m in moves] == ["actor_gen"]
    text = format_reallocations(plan, graph, specs)
    moved = plan_realloc(specs["actor"], moves[0][1], moves[0][2])
    assert "actor_gen" in text and f"{moved.total_bytes / 2**20:.2f} MiB in" in text
    assert f"sends {moved.max_sent / 2**20:.2f} MiB" in text
    assert f"receives {moved.max_received / 2**20:.2f} MiB" in text
    # a LoRA actor's kept copy receives its adapters alone; a released one the whole model
    from rayhf.models.lora import LoraConfig, with_lora

    lora = {**specs, "actor": with_lora(specs["actor"], LoraConfig(rank=2), "lora")}
    alone = plan_realloc(lora["actor"], moves[0][1], moves[0][2], skip_frozen=True)
    assert f"{alone.total_bytes / 2**20:.2f} MiB in" in format_reallocations(plan, graph, lora)
    released = dataclasses.replace(plan, released=frozenset({"actor_gen"}))
    whole = plan_realloc(lora["actor"], moves[0][1], moves[0][2])
    assert f"{whole.total_bytes / 2**20:.2f} MiB in" in format_reallocations(released, graph, lora)
    assert "its copy released" in format_plan(released, graph).splitlines()[2]


def test_a_saved_plan_is_accepted_back_as_a_manual_plan(tmp_path):
    import rayhf

    layouts = {
        n: Layout((0,) if GRAPH.by_name[n].role != "critic" else (1,), 1) for n in GRAPH.order
    }
    layouts["actor_train"] = Layout((0, 1), 1, 2)
    layouts["critic_inf"] = Layout((0, 1), 1, 1, 2, 2)
    path = tmp_path / "plan.json"
    path.write_text(Plan(layouts, "auto").to_json())
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml", [f"plan={path}"])
    cfg = cfg.with_overrides({"cluster.n_devices": 2})
    assert rayhf.make_plan(cfg).layouts == layouts


def test_home_and_role_layouts_and_the_moves_they_imply():
    a, b = Layout((0, 1), 2), Layout((0, 1), 1, 2)
    plan = Plan({c.name: a for c in GRAPH.calls} | {"actor_gen": b, "ref_inf": b}, "manual")
    assert plan.home_layouts(GRAPH) == {"actor": a, "reward": a, "ref": b, "critic": a}
    roles = plan.role_layouts(GRAPH)
    assert roles["actor"] == [a, b] and roles["ref"] == [b] and roles["critic"] == [a]
    assert plan.reallocations(GRAPH) == [("actor_gen", a, b)]  # ref is at home on b


def test_plans_round_trip_through_json():
    plan = Plan({"a": Layout((2, 0), 1, 1, 2, 4), "b": Layout((0, 1, 2, 3), 2, 2, cp=2)}, "auto")
    assert plan_from_json(plan.to_json(), "auto") == plan
    released = Plan(plan.layouts, "auto", {"a": 1}, released=frozenset({"b"}))
    assert plan_from_json(released.to_json(), "auto") == released != plan


def test_manual_plans_name_exactly_the_graph_s_calls():
    cluster = ClusterConfig(n_devices=2)
    with pytest.raises(RayhfError, match=r"plan\.actr_gen: no call of that name in graph 'ppo'"):
        make_plan(GRAPH, {"actr_gen": LayoutSpec()}, cluster)
    with pytest.raises(RayhfError, match=r"needs every call; missing plan\.actor_gen"):
        make_plan(GRAPH, {"ref_inf": LayoutSpec()}, cluster)
    for source in ("auto", "colocated"):
        assert make_plan(GRAPH, source, cluster) == colocated_plan(GRAPH, 2)


def test_a_layout_the_model_cannot_take_is_refused():
    specs = {r: _spec("llama") for r in ("actor", "ref", "critic")}  # 4 heads, 4 layers
    plan = colocated_plan(GRAPH, 8)
    check_plan_fits(plan, GRAPH, specs)
    bad = Plan({**plan.layouts, "critic_inf": Layout(tuple(range(8)), 1, 8)}, "manual")
    with pytest.raises(RayhfError, match=r"^plan\.critic_inf: .* \(role 'critic'\)$"):
        check_plan_fits(bad, GRAPH, specs)
    split = Plan({**plan.layouts, "critic_inf": Layout(tuple(range(8)), 8, cp=8)}, "manual")
    with pytest.raises(RayhfError, match=r"cp=8 does not divide the 4 attention heads of a tp"):
        check_plan_fits(split, GRAPH, specs)
    four = Layout(tuple(range(8)), 8, cp=4)  # 4 heads a rank: 1 each (kv heads repeated)
    check_plan_fits(
        dataclasses.replace(split, layouts={**split.layouts, "critic_inf": four}), GRAPH, specs
    )
    decode = Plan({**plan.layouts, "actor_gen": Layout(tuple(range(8)), 8, cp=2)}, "manual")
    with pytest.raises(RayhfError, match=r"^plan\.actor_gen\.cp: a generate call decodes each"):
        check_plan_fits(decode, GRAPH, specs)


def test_the_plan_table():
    plan = colocated_plan(GRAPH, 4)
    rows = format_plan(plan, GRAPH).splitlines()
    assert rows[0] == "plan (colocated) for graph 'ppo':" and len(rows) == 2 + len(GRAPH.calls)
    assert rows[2].split() == ["actor_gen", "actor", "generate", "0-3", "4", "1", "1", "1"]
    assert format_reallocations(plan, GRAPH, {}) == (
        "  reallocations per step: none (every call runs in its role's home layout)"
    )
