"""The hand-written placements the search must beat (``rayhf.planner.baselines``): each is a
valid plan of its own shape, tuned by the score it is given."""

from __future__ import annotations

from planner_support import GRAPH, REPO, SPECS

from rayhf.graph import load_graph
from rayhf.parallel.layout import Layout
from rayhf.planner import baselines
from rayhf.planner.plan import Plan


def _most_tp(plan: Plan) -> float:
    """A cheap score that prefers wide tensor parallelism (lower is better)."""
    return -sum(lay.tp for lay in plan.layouts.values())


def test_colocated_is_one_layout_on_every_device_for_every_call():
    plan = baselines.colocated(GRAPH, SPECS, 8, 8, _most_tp)
    assert plan.source == "colocated" and set(plan.layouts) == set(GRAPH.by_name)
    (lay,) = set(plan.layouts.values())
    assert lay.mesh == tuple(range(8)) and lay.tp == 8, "the score picked the layout"
    fewest = baselines.colocated(GRAPH, SPECS, 8, 8, lambda p: -_most_tp(p))
    assert {lay.tp for lay in fewest.layouts.values()} == {1}


def test_disjoint_gives_each_role_its_own_devices_and_one_layout():
    plan = baselines.disjoint(GRAPH, SPECS, 8, 8, _most_tp)
    assert plan.source == "disjoint" and set(plan.layouts) == set(GRAPH.by_name)
    meshes = {}
    for role in GRAPH.roles:
        (lay,) = {plan.layouts[c] for c in GRAPH.role_calls(role)}
        meshes[role] = set(lay.mesh)
    roles = sorted(meshes)
    for i, a in enumerate(roles):
        for b in roles[i + 1 :]:
            assert not meshes[a] & meshes[b], (a, b)
    # more roles than devices: the blocks wrap around and share
    two = baselines.disjoint(GRAPH, SPECS, 2, 2, _most_tp)
    assert {d for lay in two.layouts.values() for d in lay.mesh} == {0, 1}


def test_disjoint_tunes_a_role_with_the_others_on_their_own_devices():
    """While one role is tuned, no other role's calls sit on its devices (they did, which charged
    its choice for memory the others would never use there)."""
    scored: list[Plan] = []

    def record(plan: Plan) -> float:
        scored.append(plan)
        return _most_tp(plan)

    final = baselines.disjoint(GRAPH, SPECS, 16, 8, record)
    home = {r: set(final.layouts[GRAPH.role_calls(r)[0]].mesh) for r in GRAPH.roles}
    assert scored
    for plan in scored:
        for role in GRAPH.roles:
            assert all(set(plan.layouts[c].mesh) == home[role] for c in GRAPH.role_calls(role))


def test_baselines_take_any_pipeline_divisor():
    """6 devices: pp=3 and pp=6 are options (powers of two only before)."""
    pps = {lay.pp for lay in baselines._layouts_on(tuple(range(6)), SPECS["actor"], 8)}
    assert {1, 2, 3, 6} <= pps


def test_realhf_follows_its_rules_on_nodes_of_eight():
    assert baselines.realhf(GRAPH, SPECS, 1, 4, _most_tp) is None
    sft = load_graph(REPO / "graphs" / "sft.yaml")
    assert baselines.realhf(sft, SPECS, 1, 8, _most_tp) is None
    by_mbs = lambda p: p.layouts["actor_gen"].n_mbs  # noqa: E731
    one = baselines.realhf(GRAPH, SPECS, 1, 8, by_mbs)
    assert one is not None and one.source == "realhf"
    assert one.layouts["actor_gen"] == Layout(tuple(range(8)), 4, 1, 2, 1)
    assert one.layouts["actor_train"] == Layout((0, 1, 2, 3), 2, 2)  # a 7B actor: tp 2
    assert one.layouts["critic_train"] == Layout((4, 5, 6, 7), 2, 2)
    two = baselines.realhf(GRAPH, SPECS, 2, 8, by_mbs)
    assert two is not None
    assert two.layouts["actor_train"] == Layout(tuple(range(8)), 2, 4, 1)
    assert two.layouts["critic_train"] == Layout(tuple(range(8, 16)), 2, 4, 1)
    assert two.layouts["ref_inf"] == Layout(tuple(range(16)), 2, 4, 2)
