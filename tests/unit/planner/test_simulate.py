"""The planner's pure parts: cluster specs, the analytic cost model, the simulator, the search
and the baselines (no Ray, no processes)."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.models.shapes import public_shape
from rayhf.parallel.layout import Layout
from rayhf.planner import baselines
from rayhf.planner.cost import VLLM_KV_BYTES, AnalyticCost, Workload
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.plan import Plan
from rayhf.planner.search import blocks, candidates, energy, search, side_by_side
from rayhf.planner.simulate import simulate

REPO = Path(__file__).resolve().parents[3]
GRAPH = load_graph(REPO / "graphs" / "ppo.yaml")
SPECS = {
    "actor": public_shape("llama2-7b"),
    "ref": public_shape("llama2-7b"),
    "critic": public_shape("llama2-7b", value_head=True),
    "reward": public_shape("llama2-7b", value_head=True),
}
WORKS = {
    c.name: Workload(c.kind, 512, 128, 128, 4 if c.kind == "train" else 1) for c in GRAPH.calls
}


def test_cluster_specs_parse_and_name_their_links():
    c = parse_cluster("16x8xH100")
    assert (c.n_nodes, c.devices_per_node, c.n_devices) == (16, 8, 128)
    assert c.device.memory_bytes == 80e9 and "datasheet" in c.device.source
    assert c.bandwidth((0, 7)) > c.bandwidth((7, 8)), "NVLink within a node beats InfiniBand"
    with pytest.raises(RayhfError, match="NODESxDEVICESxKIND"):
        parse_cluster("16xH100")


def test_public_shapes_have_their_published_sizes():
    from rayhf.models.sharding import param_shards

    sizes = {n: sum(p.numel for p in param_shards(public_shape(n))) / 1e9 for n in
             ("llama2-7b", "llama2-13b", "codellama-34b", "llama2-70b")}  # fmt: skip
    assert sizes == pytest.approx(
        {"llama2-7b": 6.74, "llama2-13b": 13.02, "codellama-34b": 33.74, "llama2-70b": 68.98},
        abs=0.01,
    )


def test_cost_model_responds_to_layout_as_expected():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, work = SPECS["actor"], WORKS["actor_train"]
    one = cost.call(spec, Layout((0,), 1), work)
    eight_dp = cost.call(spec, Layout(tuple(range(8)), 8), work)
    eight_tp = cost.call(spec, Layout(tuple(range(8)), 1, 8), work)
    assert eight_dp.seconds < one.seconds / 4, "8 replicas cut compute time"
    assert eight_tp.memory < eight_dp.memory / 3, "tp=8 shards weights and optimizer state"
    assert one.memory > 80e9, "a 7B model with AdamW does not fit one 80 GB device"
    gen = cost.call(spec, Layout(tuple(range(8)), 8), WORKS["actor_gen"])
    assert gen.parts["decode"] > gen.parts["prefill"], "decoding 128 tokens is memory bound"


def _plan(layout_of) -> Plan:
    return Plan({c.name: layout_of(c) for c in GRAPH.calls}, "test")


def test_simulator_overlaps_disjoint_meshes_and_serializes_shared_ones():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    shared = _plan(lambda c: Layout(tuple(range(8)), 4, 2))
    sim = simulate(GRAPH, shared, SPECS, WORKS, cost)
    calls = [s for s in sim.spans if s.iteration == 0 and not s.name.startswith("realloc")]
    for a, b in itertools.pairwise(calls):
        assert b.start >= a.end - 1e-12, "calls on the same devices run one after another"
    split = {"ref": (0, 1, 2, 3), "critic": (4, 5, 6, 7)}  # each role at home on its own half
    apart = _plan(lambda c: Layout(split[c.role], 2, 2) if c.role in split else
                  Layout(tuple(range(8)), 4, 2))  # fmt: skip
    spans = {
        s.name: s for s in simulate(GRAPH, apart, SPECS, WORKS, cost).spans if s.iteration == 0
    }
    ref, critic = spans["ref_inf"], spans["critic_inf"]
    assert ref.start < critic.end and critic.start < ref.end, "disjoint meshes overlap in time"
    # On-policy: no actor call of iteration 1 starts before the actor trained in iteration 0.
    train0 = next(s for s in sim.spans if s.name == "actor_train" and s.iteration == 0)
    gen1 = next(s for s in sim.spans if s.name == "actor_gen" and s.iteration == 1)
    assert gen1.start >= train0.end


def test_reallocation_appears_when_a_role_changes_layout():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    plan = _plan(lambda c: Layout(tuple(range(8)), 8) if c.name == "actor_gen"
                 else Layout(tuple(range(8)), 2, 4))  # fmt: skip
    sim = simulate(GRAPH, plan, SPECS, WORKS, cost, n_iterations=2)
    moves = [s for s in sim.spans if s.name == "realloc:actor_gen"]
    assert len(moves) == 2 and all(m.end > m.start for m in moves)


def test_a_plan_over_memory_is_infeasible():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    crammed = _plan(lambda c: Layout((0,), 1))
    sim = simulate(GRAPH, crammed, SPECS, WORKS, cost)
    assert not sim.feasible and sim.over_memory[0][1] == 0
    assert energy(sim, 80e9) > 10 * sim.iteration_seconds


def test_candidates_respect_nodes_and_the_model():
    assert blocks(4) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    for lay in candidates(SPECS["actor"], 16, 8):
        assert lay.tp <= 8 and lay.dp * lay.tp * lay.pp == len(lay.mesh)


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
    found = search(graph, SPECS, works, cost, [start], seed=1, max_iterations=200)
    assert set(found.plan.layouts) == {c.name for c in graph.calls} and found.simulation.feasible


def test_search_is_deterministic_and_never_worse_than_its_starts():
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    cap = cost.cluster.device.memory_bytes

    def score(plan: Plan) -> float:
        return energy(simulate(GRAPH, plan, SPECS, WORKS, cost), cap)

    starts = [
        baselines.colocated(GRAPH, SPECS, 16, 8, score),
        baselines.realhf(GRAPH, SPECS, 2, 8, score),
    ]
    for s in starts:
        assert s is not None and {c.name for c in GRAPH.calls} == set(s.layouts)
    a = search(GRAPH, SPECS, WORKS, cost, starts, seed=3, max_iterations=300)
    b = search(GRAPH, SPECS, WORKS, cost, starts, seed=3, max_iterations=300)
    assert a.plan.layouts == b.plan.layouts
    assert score(a.plan) <= min(score(s) for s in starts)
    assert a.simulation.feasible


def test_rayhf_plan_searches_a_cluster_and_compares_baselines(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "rayhf", "plan", str(REPO / "examples" / "ppo_tiny.yaml"),
           "--cluster", "2x8xH100", "--shape", "actor=llama2-7b", "--shape", "ref=llama2-7b",
           "--shape", "critic=llama2-7b", "--search-seconds", "3", "--gantt",
           str(tmp_path / "g.png"), "batch_size=256"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan (search)" in proc.stdout and "estimated iteration" in proc.stdout
    for name in ("colocated", "disjoint", "realhf"):
        assert name in proc.stdout
    assert (tmp_path / "g.png").stat().st_size > 5000


def test_a_cluster_too_small_for_a_call_is_refused_naming_it():
    from rayhf.planner.auto import auto_plan, workloads

    specs = {**SPECS, "actor": public_shape("llama2-70b"), "ref": public_shape("llama2-70b")}
    works = workloads(GRAPH, 64, 128, 128, 4)
    with pytest.raises(RayhfError, match=r"call 'actor_train' \(role 'actor'\) needs at least"):
        auto_plan(GRAPH, specs, works, parse_cluster("1x2xA100"), time_limit=1)


def test_eager_launch_floor_makes_a_small_model_on_many_devices_slower_per_token():
    """Decode never beats the host's op launches, so spreading a 7B model's generation over
    more devices stops helping; a tiny micro-batch is weight-read bound, not FLOP bound."""
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec = SPECS["actor"]
    floor = spec.n_layers * cost.eff.ops_per_layer * cost.eff.op_seconds
    few = cost.decode_seconds(spec, Layout(tuple(range(2)), 2), 16, 256)
    many = cost.decode_seconds(spec, Layout(tuple(range(8)), 1, 8), 16, 256)
    assert few >= floor and many >= floor
    assert many > few, "tp=8 only adds all-reduces to a launch-bound step"
    one_seq = cost.forward_seconds(spec, Layout((0,), 1), 1, 1)
    weights = 2 * 6.5e9 / (cost.cluster.device.memory_bandwidth * cost.eff.memory)
    assert one_seq >= weights, "a one-token forward still reads every weight"


def test_a_call_at_home_of_a_trained_role_still_counts_its_cache():
    """Generation at the actor's home layout adds its KV cache on top of the resident state."""
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    lay = Layout(tuple(range(16)), 2, 8)
    plan = _plan(lambda c: lay)
    sim = simulate(GRAPH, plan, SPECS, WORKS, cost)
    resident = sum(cost.resident(SPECS[r], lay, r in ("actor", "critic")) for r in SPECS)
    gen = cost.memory(SPECS["actor"], lay, WORKS["actor_gen"]) - cost.resident(
        SPECS["actor"], lay, False
    )
    assert gen > 0 and sim.peak_memory[0] >= resident + gen - 1


def test_local_improvement_never_worsens_a_plan_and_is_deterministic():
    from rayhf.planner.search import _Scorer, improve

    cost = AnalyticCost(parse_cluster("2x8xH100"))
    options = {c.name: candidates(SPECS.get(c.role), 16, 8) for c in GRAPH.calls}
    start = dict(baselines.colocated(GRAPH, SPECS, 16, 8, _score(cost)).layouts)
    runs = []
    for _ in range(2):
        score = _Scorer(GRAPH, SPECS, WORKS, cost, deadline=float("inf"))
        runs.append(improve(start, options, GRAPH, score))
        assert runs[-1][1] <= score(start)
    assert runs[0] == runs[1]


def test_search_improves_on_the_colocated_plan():
    """One layout for every call is a compromise: the search gives each call its own."""
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    score = _score(cost)
    start = baselines.colocated(GRAPH, SPECS, 16, 8, score)
    found = search(GRAPH, SPECS, WORKS, cost, [start], seed=0, max_iterations=200)
    assert found.simulation.feasible
    assert score(found.plan) < 0.95 * score(start)


def _score(cost: AnalyticCost):
    cap = cost.cluster.device.memory_bytes
    return lambda plan: energy(simulate(GRAPH, plan, SPECS, WORKS, cost), cap)


def test_engines_change_the_memory_the_planner_counts():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    spec, lay = SPECS["actor"], Layout(tuple(range(8)), dp=8)
    train = WORKS["actor_train"]
    torch_b = cost.resident(spec, lay, True, train)
    by_stage = [
        cost.resident(spec, lay, True, dataclasses.replace(train, engine="deepspeed", zero_stage=z))
        for z in (1, 2, 3)
    ]
    assert torch_b > by_stage[0] > by_stage[1] > by_stage[2]
    weights = cost.resident(spec, lay, False)
    assert by_stage[2] == pytest.approx(weights * 2 / 8 + (torch_b - 2 * weights) / 8)
    offload = dataclasses.replace(train, engine="deepspeed", zero_stage=2, offload=True)
    assert cost.resident(spec, lay, True, offload) == pytest.approx(weights + weights / 8)
    gen = WORKS["actor_gen"]
    vllm = dataclasses.replace(gen, engine="vllm")
    extra = cost.memory(spec, lay, vllm) - cost.memory(spec, lay, gen)
    assert extra == pytest.approx(weights + VLLM_KV_BYTES)  # its own weights and KV cache
    plan = Plan({c.name: lay for c in GRAPH.calls}, "colocated")
    works = {**WORKS, "actor_gen": vllm}
    plain, with_vllm = (simulate(GRAPH, plan, SPECS, w, cost) for w in (WORKS, works))
    assert max(with_vllm.peak_memory.values()) == pytest.approx(
        max(plain.peak_memory.values()) + extra
    )


def test_search_keeps_vllm_and_deepspeed_calls_data_parallel():
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    cap = cost.cluster.device.memory_bytes
    works = {
        **WORKS,
        "actor_gen": dataclasses.replace(WORKS["actor_gen"], engine="vllm"),
        "critic_train": dataclasses.replace(
            WORKS["critic_train"], engine="deepspeed", zero_stage=3
        ),
    }

    def score(plan: Plan) -> float:
        return energy(simulate(GRAPH, plan, SPECS, works, cost), cap)

    tp2 = Plan({c.name: Layout(tuple(range(8)), 4, 2) for c in GRAPH.calls}, "tp2")
    refused = simulate(GRAPH, tp2, SPECS, works, cost).refused
    assert refused == ["actor_gen", "critic_inf", "critic_train"]  # critic_inf: on ZeRO-3 ranks
    assert score(tp2) == float("inf")
    starts = [baselines.colocated(GRAPH, SPECS, 8, 8, score)]
    found = search(GRAPH, SPECS, works, cost, starts, seed=1, max_iterations=300)
    for name in ("actor_gen", "critic_train"):
        lay = found.plan.layouts[name]
        assert (lay.tp, lay.pp) == (1, 1), name
    # ZeRO-3 ranks hold slices: the critic's inference runs in a layout of its own
    assert found.plan.layouts["critic_inf"] != found.plan.layouts["critic_train"]
    assert found.simulation.feasible and score(starts[0]) == float("inf")


def test_rayhf_plan_shows_memory_per_device_with_the_engines(tmp_path):
    import re
    import subprocess
    import sys

    def peak(*extra: str) -> float:
        cmd = [sys.executable, "-m", "rayhf", "plan", str(REPO / "examples" / "ppo_vllm.yaml"),
               *extra]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        found = re.findall(r"d\d+ ([\d.]+) MiB", proc.stdout.split("memory per device")[1])
        return max(float(x) for x in found)

    with_engines, without = peak(), peak("engines={}")
    assert with_engines - without == pytest.approx(VLLM_KV_BYTES / 2**20, rel=0.01)
