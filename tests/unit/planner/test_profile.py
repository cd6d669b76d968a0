"""The profiled cost model: measured engine times, their composition under layouts, the
runtime constants fitted from runs, and ``plan: auto`` on emulated CPU devices (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_support import GRAPH
from transformers import LlamaConfig

from rayhf.models.sharding import param_shards
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout
from rayhf.planner.auto import StepBatch, workloads
from rayhf.planner.cost import max_shard_params
from rayhf.planner.hardware import CPU_LINK_BANDWIDTH, CPU_ZERO3_PER_TENSOR, cpu_cluster
from rayhf.planner.plan import Plan, colocated_plan
from rayhf.planner.problem import Problem
from rayhf.planner.profile import (
    MeasuredRun,
    ModelProfile,
    OpFit,
    ProfiledCost,
    calibrate,
)
from rayhf.planner.simulate import simulate


def tiny(value_head: bool = False):
    config = LlamaConfig(
        vocab_size=26, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=176, max_position_embeddings=128,
    )  # fmt: skip
    return config, model_spec(config, value_head)


def synthetic_profile() -> ModelProfile:
    """Round numbers, so compositions can be checked by hand."""
    fwd = OpFit((1e-3, 1e-6, 0.0), (1e-4, 1e-5, 0.0))
    train = OpFit((2e-3, 3e-6, 0.0), (3e-4, 3e-5, 0.0))
    gen = OpFit((1e-3, 1e-6, 1e-4, 1e-6), (1e-4, 1e-5, 1e-3, 1e-5))
    return ModelProfile("synthetic", 1, fwd, train, gen)


def synthetic_cost(**kw) -> tuple[ProfiledCost, dict]:
    _, spec = tiny()
    _, critic = tiny(value_head=True)
    profiles = {dataclasses.replace(s, n_layers=0): synthetic_profile() for s in (spec, critic)}
    specs = {"actor": spec, "ref": spec, "critic": critic}
    return ProfiledCost(cpu_cluster(2, 4.0), profiles, **kw), specs


def test_layouts_compose_the_profile_as_rayhf_executes():
    cost, specs = synthetic_cost()
    spec = specs["actor"]
    work = workloads(GRAPH, StepBatch(32, 16, 8, 4))
    one = cost.call(spec, Layout((0,), 1), work["ref_inf"]).seconds
    dp2 = cost.call(spec, Layout((0, 1), 2), work["ref_inf"]).seconds
    tp2 = cost.call(spec, Layout((0, 1), 1, 2), work["ref_inf"]).seconds
    pp2 = cost.call(spec, Layout((0, 1), 1, 1, 2), work["ref_inf"]).seconds
    assert dp2 < one, "data parallel halves each replica's tokens"
    assert tp2 > dp2, "tp pays two all-reduces per layer that dp does not"
    assert pp2 > dp2, "a GPipe pass over one micro-batch serializes the stages"
    gen_tp = cost.call(spec, Layout((0, 1), 1, 2), work["actor_gen"]).parts["generate"]
    gen_one = cost.call(spec, Layout((0,), 1), work["actor_gen"]).parts["generate"]
    assert gen_tp > gen_one, "tp decode pays per-token all-reduce latency (2 ms on gloo)"


def test_calibration_recovers_the_runtime_constants():
    cost, specs = synthetic_cost()
    works = workloads(GRAPH, StepBatch(32, 16, 8, 4))
    truth = ProfiledCost(cost.cluster, cost.profiles, 0.01, {1: (0.02, 1.5), 2: (0.005, 3.0)})
    runs = []
    for plan in (colocated_plan(GRAPH, 1), colocated_plan(GRAPH, 2)):
        compute = {}
        for name in GRAPH.order:
            role = GRAPH.by_name[name].role
            if role in specs:
                parts = truth.call(specs[role], plan.layouts[name], works[name]).parts
                compute[name] = sum(v for k, v in parts.items() if k != "driver")
                assert parts["actor"] > 0
            else:
                compute[name] = 0.0
        step = sum(compute.values()) + 0.01 * len(GRAPH.order)
        runs.append(MeasuredRun(plan, step, compute))
    fitted = calibrate(cost, GRAPH, [(specs, works, run) for run in runs])
    assert fitted.call_overhead == pytest.approx(0.01)
    for k, (fixed, scale) in {1: (0.02, 1.5), 2: (0.005, 3.0)}.items():
        assert fitted.actor[k] == pytest.approx((fixed, scale), rel=1e-6, abs=1e-9)
    plan = colocated_plan(GRAPH, 2)
    est = simulate(Problem(GRAPH, specs, works, fitted, concurrent=False), plan).iteration_seconds
    assert est == pytest.approx(runs[1].step_seconds)


def test_sequential_driver_adds_up_what_the_concurrent_one_overlaps():
    cost, specs = synthetic_cost(call_overhead=0.0)
    works = workloads(GRAPH, StepBatch(32, 16, 8, 4))
    apart = {n: Layout((0,) if GRAPH.by_name[n].role != "critic" else (1,), 1) for n in GRAPH.order}
    plan = Plan(apart, "test")
    together = simulate(Problem(GRAPH, specs, works, cost, concurrent=True), plan).iteration_seconds
    in_turn = simulate(Problem(GRAPH, specs, works, cost, concurrent=False), plan).iteration_seconds
    assert in_turn > together, "critic calls overlap actor calls only in the concurrent driver"


def test_zero3_pays_its_gathers_only_where_it_has_ranks_to_shard_over():
    cost, specs = synthetic_cost()
    spec = specs["actor"]
    work = workloads(GRAPH, StepBatch(32, 16, 8, 4))["actor_train"]

    def extra(layout: Layout) -> float:
        return (
            cost.call(spec, layout, work.with_stage(3)).seconds
            - cost.call(spec, layout, work.with_stage(2)).seconds
        )

    assert extra(Layout((0,), 1)) == 0.0
    shard = max_shard_params(spec, 1, 1) * 4
    per_minibatch = shard / 2 / CPU_LINK_BANDWIDTH + len(param_shards(spec)) * CPU_ZERO3_PER_TENSOR
    assert extra(Layout((0, 1), 2)) == pytest.approx(work.n_minibatches * per_minibatch)


def test_a_profiled_train_call_pays_for_its_epochs_and_its_forward_without_gradients():
    cost, specs = synthetic_cost()
    works = workloads(GRAPH, StepBatch(8, 16, 16, 2))
    lay, train, infer = Layout((0,), 1), works["actor_train"], works["ref_inf"]
    one = cost.call(specs["actor"], lay, train)
    two = cost.call(specs["actor"], lay, dataclasses.replace(train, epochs=2))
    assert two.parts["train"] == pytest.approx(2 * one.parts["train"])
    whole = cost.call(specs["actor"], lay, dataclasses.replace(train, forward_share=1.0))
    forward = cost.call(specs["ref"], lay, infer).parts["forward"]  # the same 8 sequences
    assert whole.parts["forward"] == pytest.approx(forward) and forward > 0
    assert whole.seconds == pytest.approx(one.seconds + forward)


def test_a_call_waits_on_the_links_for_its_collectives_latency_and_zero3_fetches():
    cost, specs = synthetic_cost(actor={1: (0.0, 1.0), 2: (0.01, 1.5)})
    spec, lat = specs["actor"], cost.cluster.link_latency
    work = workloads(GRAPH, StepBatch(32, 16, 8, 4))
    one, tp2, dp2 = Layout((0,), 1), Layout((0, 1), 1, 2), Layout((0, 1), 2)
    assert cost.call(spec, one, work["actor_gen"]).waits == 0.0
    gen = cost.call(spec, tp2, work["actor_gen"])
    # two all-reduces per layer for every new token, scaled as the rest of the call
    assert gen.waits == pytest.approx(1.5 * 8 * spec.n_layers * 2 * lat)
    assert gen.waits < gen.seconds
    train = work["actor_train"]
    z2, z3 = (cost.call(spec, dp2, train.with_stage(s)).waits for s in (2, 3))
    assert z2 == pytest.approx(1.5 * train.n_minibatches * lat)  # the gradients' all-reduce
    fetches = train.n_minibatches * len(param_shards(spec)) * CPU_ZERO3_PER_TENSOR
    assert z3 - z2 == pytest.approx(1.5 * fetches)


def test_on_shared_cores_a_call_s_waits_are_not_stretched():
    """4 emulated devices on 2 cores: a call on all 4 takes twice its compute, but its waits on
    the links once."""
    two_devices, specs = synthetic_cost()  # its profiles, on 4 devices below
    works = workloads(GRAPH, StepBatch(32, 16, 8, 4))
    every = Plan({n: Layout((0, 1, 2, 3), 2, 2) for n in GRAPH.order}, "test")

    def priced(cores: float) -> tuple[float, ProfiledCost]:
        cost = ProfiledCost(cpu_cluster(4, 4.0, cores), two_devices.profiles)
        return simulate(Problem(GRAPH, specs, works, cost), every).iteration_seconds, cost

    own, cost = priced(0.0)
    shared, _ = priced(2.0)
    waits = sum(
        cost.call(specs[GRAPH.by_name[n].role], every.layouts[n], works[n]).waits
        for n in GRAPH.order
        if GRAPH.by_name[n].role in specs
    )
    assert waits > 0
    assert shared == pytest.approx(2 * own - waits)
