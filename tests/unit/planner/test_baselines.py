"""The hand-written placements the search must beat (``rayhf.planner.baselines``): each is a
valid plan of its own shape, tuned by the score it is given."""

from __future__ import annotations

import pytest
from planner_support import GRAPH, REPO, SPECS, WORKS
from transformers import LlamaConfig

from rayhf.graph import load_graph
from rayhf.models.shapes import public_shape
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout
from rayhf.planner import baselines
from rayhf.planner.auto import open_stages
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import cpu_cluster, parse_cluster
from rayhf.planner.plan import Plan
from rayhf.planner.problem import Problem
from rayhf.planner.search import layouts_on
from rayhf.planner.simulate import simulate


def _most_tp(plan: Plan) -> float:
    """A cheap score that prefers wide tensor parallelism (lower is better)."""
    return -sum(lay.tp for lay in plan.layouts.values())


def _problem(n: int, per_node: int, graph=GRAPH) -> Problem:
    return Problem(
        graph, SPECS, WORKS, AnalyticCost(parse_cluster(f"{n // per_node}x{per_node}xH100"))
    )


def _setting(n: int, per_node: int, score=_most_tp) -> baselines.Setting:
    """A setting on ``n`` H100s, ``per_node`` to a node, that tries every layout."""
    return baselines.Setting(_problem(n, per_node), score, ranked=False)


def _priced(cluster: str, actor: str = "llama2-7b", critic: str = "llama2-7b", gen: int = 128):
    """A setting scored by the simulator on ``cluster``, train calls open to every ZeRO stage."""
    specs = {
        "actor": public_shape(actor),
        "ref": public_shape(actor),
        "critic": public_shape(critic, value_head=True),
        "reward": public_shape(critic, value_head=True),
    }
    works = open_stages({
        c.name: Workload(c.kind, 512, 128, gen, 4 if c.kind == "train" else 1)
        for c in GRAPH.calls
    })  # fmt: skip
    cost = AnalyticCost(parse_cluster(cluster))
    return baselines.Setting.priced(Problem(GRAPH, specs, works, cost))


def _role_devices(plan: Plan) -> dict[str, set[int]]:
    return {r: {d for c in GRAPH.role_calls(r) for d in plan.layouts[c].mesh} for r in GRAPH.roles}


def _pairwise_disjoint(meshes: dict[str, set[int]]) -> bool:
    keys = sorted(meshes)
    return all(not meshes[a] & meshes[b] for i, a in enumerate(keys) for b in keys[i + 1 :])


def test_colocated_is_one_layout_on_every_device_for_every_call():
    plan = baselines.colocated(_setting(8, 8))
    assert plan.source == "colocated" and set(plan.layouts) == set(GRAPH.by_name)
    (lay,) = set(plan.layouts.values())
    assert lay.mesh == tuple(range(8)) and lay.tp == 8, "the score picked the layout"
    fewest = baselines.colocated(_setting(8, 8, lambda p: -_most_tp(p)))
    assert {lay.tp for lay in fewest.layouts.values()} == {1}


def test_disjoint_gives_each_role_its_own_devices():
    plan = baselines.disjoint(_setting(8, 8))
    assert plan.source == "disjoint" and set(plan.layouts) == set(GRAPH.by_name)
    assert _pairwise_disjoint(_role_devices(plan))
    # more roles than devices: the blocks wrap around and share
    two = baselines.disjoint(_setting(2, 2))
    assert {d for lay in two.layouts.values() for d in lay.mesh} == {0, 1}


def test_disjoint_tunes_every_role_on_its_own_devices():
    """No plan it scores puts a role's calls on another role's devices (the others sat on the
    tuned role's devices once, which charged its choice for memory they would never use)."""
    scored: list[Plan] = []

    def record(plan: Plan) -> float:
        scored.append(plan)
        return _most_tp(plan)

    baselines.disjoint(_setting(16, 8, record))
    assert len(scored) > 10
    assert all(_pairwise_disjoint(_role_devices(p)) for p in scored)


def test_disjoint_fits_where_a_disjoint_plan_fits():
    """13B models on 32 H100: the earlier disjoint baseline did not fit memory (its blocks were
    fixed by parameter counts); here a disjoint plan fits, so the baseline must."""
    setting = _priced("4x8xH100", "llama2-13b", "llama2-13b")
    by_hand = Plan({
        "actor_gen": Layout(tuple(range(16)), 4, 4),
        "actor_train": Layout(tuple(range(16)), 4, 4),
        "critic_inf": Layout(tuple(range(16, 24)), 2, 4),
        "critic_train": Layout(tuple(range(16, 24)), 1, 4, 2, 8),
        "ref_inf": Layout(tuple(range(24, 28)), 1, 4),
        "rew_inf": Layout(tuple(range(28, 32)), 1, 4),
    }, "by hand")  # fmt: skip
    sim = lambda p: simulate(setting.problem, p)  # noqa: E731
    assert _pairwise_disjoint(_role_devices(by_hand)) and sim(by_hand).feasible
    plan = baselines.disjoint(setting)
    assert _pairwise_disjoint(_role_devices(plan)) and sim(plan).feasible
    assert setting.score(plan) <= setting.score(by_hand)


def test_verl_colocates_every_call_trains_at_zero3_and_reshards_for_generation():
    setting = _priced("2x8xH100")
    plan = baselines.verl(setting)
    assert plan is not None and plan.source == "verl"
    assert plan.layouts and all(lay.mesh == tuple(range(16)) for lay in plan.layouts.values())
    assert plan.zero == {"actor_train": 3, "critic_train": 3}
    for name in ("actor_train", "critic_train"):
        assert (plan.layouts[name].tp, plan.layouts[name].pp) == (1, 1)  # FSDP-like: dp only
    gen = plan.layouts["actor_gen"]
    assert gen.pp == 1 and gen != plan.layouts["actor_train"]
    sim = simulate(setting.problem, plan)
    moved = {s.name for s in sim.spans}
    assert "realloc:actor_gen" in moved  # the resharding into the rollout layout is priced
    assert sim.stages == plan.zero and sim.feasible


def test_openrlhf_generates_on_devices_of_its_own_and_trains_at_zero3():
    setting = _priced("2x8xH100")
    plan = baselines.openrlhf(setting)
    assert plan is not None and plan.source == "openrlhf"
    meshes = _role_devices(plan)
    meshes["actor"] = set(plan.layouts["actor_train"].mesh)
    meshes["engines"] = set(plan.layouts["actor_gen"].mesh)
    assert _pairwise_disjoint(meshes)
    assert plan.zero == {"actor_train": 3, "critic_train": 3}
    assert plan.layouts["actor_gen"].pp == 1
    sim = simulate(setting.problem, plan)
    assert "realloc:actor_gen" in {s.name for s in sim.spans}  # the weights broadcast


@pytest.mark.parametrize("build", [baselines.verl, baselines.openrlhf])
def test_zero3_baselines_need_an_engine_that_offers_it(build):
    """The workloads as a run configures them (torch training, no stage choice): no plan."""
    assert build(_setting(16, 8)) is None


def test_baselines_take_any_pipeline_divisor():
    """6 devices: pp=3 and pp=6 are options (powers of two only before)."""
    pps = {lay.pp for lay in layouts_on(tuple(range(6)), SPECS["actor"], 8)}
    assert {1, 2, 3, 6} <= pps


def test_realhf_follows_its_rules_on_nodes_of_eight():
    assert baselines.realhf(_setting(4, 4)) is None
    sft = load_graph(REPO / "graphs" / "sft.yaml")
    assert baselines.realhf(baselines.Setting(_problem(8, 8, sft), _most_tp, ranked=False)) is None
    by_mbs = lambda p: p.layouts["actor_gen"].n_microbatches  # noqa: E731
    one = baselines.realhf(_setting(8, 8, by_mbs))
    assert one is not None and one.source == "realhf"
    assert one.layouts["actor_gen"] == Layout(tuple(range(8)), 4, 1, 2, 1)
    assert one.layouts["actor_train"] == Layout((0, 1, 2, 3), 2, 2)  # a 7B actor: tp 2
    assert one.layouts["critic_train"] == Layout((4, 5, 6, 7), 2, 2)
    two = baselines.realhf(_setting(16, 8, by_mbs))
    assert two is not None
    assert two.layouts["actor_train"] == Layout(tuple(range(8)), 2, 4, 1)
    assert two.layouts["critic_train"] == Layout(tuple(range(8, 16)), 2, 4, 1)
    assert two.layouts["ref_inf"] == Layout(tuple(range(16)), 2, 4, 2)


def test_zero3_baselines_shard_only_groups_with_ranks_to_shard_over():
    """On 4 emulated devices OpenRLHF's groups are small: a one-device train call has nothing
    to shard, so its stage is left to the rule, and no call is refused (ZeRO-3 with a single
    rank would hold the role's weights as slices its inference call cannot use)."""
    config = LlamaConfig(
        vocab_size=26, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=176, max_position_embeddings=128,
    )  # fmt: skip
    specs = {"actor": model_spec(config, False), "ref": model_spec(config, False),
             "critic": model_spec(config, True), "reward": model_spec(config, True)}  # fmt: skip
    works = open_stages({
        c.name: Workload(c.kind, 32, 16, 12, 4 if c.kind == "train" else 1) for c in GRAPH.calls
    })  # fmt: skip
    cost = AnalyticCost(cpu_cluster(4, 4.0, cores=2))
    setting = baselines.Setting.priced(Problem(GRAPH, specs, works, cost))
    for plan in (baselines.openrlhf(setting), baselines.verl(setting)):
        assert plan is not None
        for name in ("actor_train", "critic_train"):
            assert (plan.zero.get(name) == 3) == (plan.layouts[name].dp > 1)
        assert not simulate(Problem(GRAPH, specs, works, cost), plan).refused
