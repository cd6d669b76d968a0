"""The plan search (``rayhf.planner.search``): candidate meshes and layouts, local improvement
and annealing, deterministic for a seed and never worse than its starts (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_support import GRAPH, REPO, SPECS, WORKS

from rayhf.engines.config import DeepSpeedEngineConfig, VllmEngineConfig
from rayhf.graph import load_graph
from rayhf.models.shapes import public_shape
from rayhf.parallel.layout import Layout, stage_major
from rayhf.planner import baselines
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.search import blocks, call_layouts, candidates, energy, search, side_by_side
from rayhf.planner.simulate import simulate


def test_candidates_respect_nodes_and_the_model():
    assert blocks(4) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    for lay in candidates(SPECS["actor"], 16, 8):
        assert lay.tp <= 8 and lay.dp * lay.tp * lay.pp == len(lay.mesh)


def test_an_moe_model_s_calls_may_split_experts_except_the_generate_call():
    """Every ep that divides dp and the experts is a candidate for training and inference; the
    search does not price the decode step's exchanges, so it never gives a generate call more."""
    moe = public_shape("qwen3-30b-a3b")
    options = candidates(moe, 16, 8)
    assert {lay.ep for lay in options} == {1, 2, 4, 8, 16}
    assert all(lay.dp % lay.ep == 0 for lay in options)
    assert {lay.ep for lay in candidates(SPECS["actor"], 16, 8)} == {1}
    generate = call_layouts(moe, WORKS["actor_gen"], 16, 8)
    assert generate and {lay.ep for lay in generate} == {1}
    assert {lay.ep for lay in call_layouts(moe, WORKS["actor_train"], 16, 8)} > {1}


def test_long_inference_and_train_calls_may_split_their_sequences():
    """A call of 4,096 tokens or more a sequence may take cp over any power of two of its dp
    ranks that divides the heads (Qwen2.5-7B's 28: 2 and 4); a generate call, a shorter call and
    a DeepSpeed one (which splits no sequence) none."""
    spec = public_shape("qwen2.5-7b")
    long_train = Workload("train", 64, 1024, 8192, 4)
    splits = {lay.cp for lay in call_layouts(spec, long_train, 8, 8)}
    assert splits == {1, 2, 4}
    for lay in call_layouts(spec, long_train, 8, 8):
        assert lay.dp % lay.cp == 0 and (spec.n_heads // lay.tp) % lay.cp == 0
    assert {
        lay.cp for lay in call_layouts(spec, dataclasses.replace(long_train, kind="generate"), 8, 8)
    } == {1}
    assert {lay.cp for lay in call_layouts(spec, WORKS["actor_train"], 8, 8)} == {1}
    deepspeed = long_train.with_stage(3)
    assert {lay.cp for lay in call_layouts(spec, deepspeed, 8, 8)} == {1}


def test_a_pipelined_expert_split_is_offered_in_megatron_s_rank_order_too():
    """At tp x pp = 8 on 8-GPU nodes an ep group of dp-outer ranks spans nodes; the same layout
    with its mesh in ``stage_major`` order keeps it in one, and the cost model prices that."""
    moe, mesh = public_shape("qwen3-30b-a3b"), tuple(range(32))
    options = [lay for lay in candidates(moe, 32, 8) if lay.mesh[0] == 0 and len(lay.mesh) == 32]
    split = [lay for lay in options if (lay.dp, lay.tp, lay.pp, lay.ep) == (2, 4, 4, 2)]
    assert {lay.mesh for lay in split} == {mesh, stage_major(mesh, 2, 4, 4)}
    assert all(lay.mesh == mesh for lay in options if lay.ep == 1 or lay.pp == 1)
    cost = AnalyticCost(parse_cluster("4x8xH100"))
    outer, inner = (Layout(m, 2, 4, 4, 8, ep=2) for m in (mesh, stage_major(mesh, 2, 4, 4)))
    assert (
        cost.exchange_seconds(moe, inner, 1e5, True)
        < cost.exchange_seconds(moe, outer, 1e5, True) / 4
    ), "an ep group inside a node exchanges over NVLink"


def test_meshes_are_blocks_inside_a_node_or_runs_of_whole_nodes():
    meshes = blocks(24, 8)
    for mesh in meshes:
        if len(mesh) < 8:  # inside one node, aligned to its size
            assert mesh[0] // 8 == mesh[-1] // 8 and mesh[0] % len(mesh) == 0
        else:
            assert len(mesh) % 8 == 0 and mesh[0] % 8 == 0
    runs = {(m[0], len(m)) for m in meshes if len(m) >= 8}
    assert runs == {(0, 8), (8, 8), (16, 8), (0, 16), (8, 16), (0, 24)}
    # Three nodes take pp=3, which no power-of-two block allows.
    three = [lay for lay in candidates(SPECS["actor"], 24, 8) if len(lay.mesh) == 24]
    assert {(lay.tp, lay.pp) for lay in three} >= {(8, 3), (4, 3), (4, 6), (1, 3)}


def test_side_by_side_cuts_a_cluster_at_every_node_boundary():
    pairs = side_by_side(32, 8)
    for a, b in pairs:
        assert not set(a) & set(b) and a[-1] + 1 == b[0]
    cuts = {len(a) for a, b in pairs if len(a) + len(b) == 32}
    assert cuts == {8, 16, 24}  # a small critic beside a large actor needs the uneven cuts


def test_search_plans_a_graph_of_one_call():
    graph = load_graph(REPO / "graphs" / "sft.yaml")
    works = {c.name: Workload(c.kind, 64, 128, 128, 2) for c in graph.calls}
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    start = Plan({c.name: Layout(tuple(range(8)), dp=8) for c in graph.calls}, "start")
    found = search(Problem(graph, SPECS, works, cost), [start], seed=1, max_iterations=200)
    assert set(found.plan.layouts) == {c.name for c in graph.calls} and found.simulation.feasible


def test_search_is_deterministic_and_never_worse_than_its_starts():
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    cap = cost.cluster.device.memory_bytes

    def score(plan: Plan) -> float:
        return energy(simulate(Problem(GRAPH, SPECS, WORKS, cost), plan), cap)

    setting = baselines.Setting(Problem(GRAPH, SPECS, WORKS, cost), score, ranked=False)
    starts = [baselines.colocated(setting), baselines.realhf(setting)]
    for s in starts:
        assert s is not None and {c.name for c in GRAPH.calls} == set(s.layouts)
    a = search(Problem(GRAPH, SPECS, WORKS, cost), starts, seed=3, max_iterations=300)
    b = search(Problem(GRAPH, SPECS, WORKS, cost), starts, seed=3, max_iterations=300)
    assert a.plan.layouts == b.plan.layouts
    assert score(a.plan) <= min(score(s) for s in starts)
    assert a.simulation.feasible


@pytest.mark.slow
def test_local_improvement_never_worsens_a_plan_and_is_deterministic():
    from rayhf.planner.search import _Scorer, improve

    cost = AnalyticCost(parse_cluster("2x4xH100"))  # 2x8: 15 s a run here, the same moves
    options = {c.name: candidates(SPECS.get(c.role), 8, 4) for c in GRAPH.calls}
    start = dict(baselines.colocated(_setting(cost)).layouts)
    runs = []
    for _ in range(2):
        score = _Scorer(Problem(GRAPH, SPECS, WORKS, cost), deadline=float("inf"))
        runs.append(improve(start, options, GRAPH, score))
        assert runs[-1][1] < 0.9 * score(start)
    assert runs[0] == runs[1]


def test_search_improves_on_the_colocated_plan():
    """One layout for every call is a compromise: the search gives each call its own."""
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    score = _score(cost)
    start = baselines.colocated(_setting(cost))
    found = search(Problem(GRAPH, SPECS, WORKS, cost), [start], seed=0, max_iterations=200)
    assert found.simulation.feasible
    assert score(found.plan) < 0.95 * score(start)


def _score(cost: AnalyticCost):
    cap = cost.cluster.device.memory_bytes
    return lambda plan: energy(simulate(Problem(GRAPH, SPECS, WORKS, cost), plan), cap)


def _setting(cost: AnalyticCost) -> baselines.Setting:
    return baselines.Setting.priced(Problem(GRAPH, SPECS, WORKS, cost))


def test_search_keeps_vllm_and_deepspeed_calls_data_parallel():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    cap = cost.cluster.device.memory_bytes
    works = {
        **WORKS,
        "actor_gen": dataclasses.replace(WORKS["actor_gen"], engine=VllmEngineConfig()),
        "critic_train": dataclasses.replace(
            WORKS["critic_train"], engine=DeepSpeedEngineConfig(), zero_stage=3
        ),
    }

    def score(plan: Plan) -> float:
        return energy(simulate(Problem(GRAPH, SPECS, works, cost), plan), cap)

    tp2 = Plan({c.name: Layout(tuple(range(8)), 4, 2) for c in GRAPH.calls}, "tp2")
    refused = simulate(Problem(GRAPH, SPECS, works, cost), tp2).refused
    assert refused == ["actor_gen", "critic_inf", "critic_train"]  # critic_inf: on ZeRO-3 ranks
    assert score(tp2) == float("inf")
    starts = [
        baselines.colocated(
            baselines.Setting(Problem(GRAPH, SPECS, works, cost), score, ranked=False)
        )
    ]
    found = search(Problem(GRAPH, SPECS, works, cost), starts, seed=1, max_iterations=300)
    for name in ("actor_gen", "critic_train"):
        lay = found.plan.layouts[name]
        assert (lay.tp, lay.pp) == (1, 1), name
    # ZeRO-3 ranks hold slices: the critic's inference runs in a layout of its own
    assert found.plan.layouts["critic_inf"] != found.plan.layouts["critic_train"]
    assert found.simulation.feasible and score(starts[0]) == float("inf")
