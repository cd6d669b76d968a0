"""``plan: auto`` (``rayhf.planner.auto``): workloads per call, when a run searches, the refusal
of a cluster too small, and the report beside the baselines (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
from planner_support import GRAPH, SPECS, WORKS

from rayhf.engines.config import DeepSpeedEngineConfig, TorchEngineConfig, VllmEngineConfig
from rayhf.errors import RayhfError
from rayhf.models.shapes import public_shape
from rayhf.parallel.layout import Layout
from rayhf.planner import auto
from rayhf.planner.auto import (
    AutoPlan,
    RunDevices,
    StepBatch,
    colocated_for_run,
    format_auto,
    open_stages,
    plan_for_run,
    run_cost,
    searches,
    step_estimates,
    workloads,
)
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.cost import AnalyticCost, Workload
from rayhf.planner.hardware import parse_cluster
from rayhf.planner.plan import Plan, colocated_plan
from rayhf.planner.problem import Problem
from rayhf.planner.profile import ModelProfile, OpFit
from rayhf.planner.search import SearchResult
from rayhf.planner.simulate import Simulation, simulate
from rayhf.planner.step import StepOptions


def test_a_cluster_too_small_for_a_call_is_refused_naming_it():
    from rayhf.planner.auto import auto_plan, workloads

    specs = {**SPECS, "actor": public_shape("llama2-70b"), "ref": public_shape("llama2-70b")}
    works = workloads(GRAPH, StepBatch(64, 128, 128, 4))
    with pytest.raises(RayhfError, match=r"call 'actor_train' \(role 'actor'\) needs at least"):
        auto_plan(Problem(GRAPH, specs, works, AnalyticCost(parse_cluster("1x2xA100"))), 0, 1)


def test_workloads_carry_each_call_s_engine_and_optimizer_sharding():
    engines = {
        "actor_gen": VllmEngineConfig(),
        "critic_train": DeepSpeedEngineConfig(zero_stage=3, offload=True),
    }
    works = workloads(GRAPH, StepBatch(64, 16, 8, 4), engines, zero1_roles={"actor"})
    assert set(works) == set(GRAPH.by_name)
    assert works["actor_gen"] == Workload("generate", 64, 16, 8, 1, VllmEngineConfig())
    assert works["ref_inf"] == Workload("inference", 64, 16, 8, 1)
    assert works["actor_train"] == Workload("train", 64, 16, 8, 4, None, 1)  # torch, ZeRO-1
    assert works["actor_train"].engine == TorchEngineConfig()
    z3 = engines["critic_train"]
    assert works["critic_train"] == Workload("train", 64, 16, 8, 4, z3, 3, True)
    assert works["actor_gen"].whole_model_ranks and not works["actor_train"].whole_model_ranks


def test_several_devices_are_searched_one_is_the_colocated_plan():
    assert searches(ClusterConfig(n_devices=2))
    assert searches(ClusterConfig(n_devices=8, device="cuda"))
    assert not searches(ClusterConfig(n_devices=1))
    assert not searches(ClusterConfig(n_devices=1, device="cuda"))


QWEN = "qwen2.5-0.5b"
GPU_SPECS = {
    "actor": public_shape(QWEN),
    "ref": public_shape(QWEN),
    "critic": public_shape(QWEN, value_head=True),
    "reward": public_shape(QWEN, value_head=True),
}


def gpu_profiles(fixed: float) -> dict:
    """A GPU-like profile per shape: ``fixed`` seconds a call whatever its size (launches, the
    interface's Python), the rest linear in tokens; decoding a fixed cost per new token."""
    prof = ModelProfile(
        "injected", 0,
        forward=OpFit((fixed, 2e-7, 0.0), (0.0, 4e-8, 0.0)),
        train=OpFit((3 * fixed, 6e-7, 0.0), (0.0, 1.2e-7, 0.0)),
        generate=OpFit((fixed, 0.0, 2e-3, 0.0), (0.0, 0.0, 4e-4, 1e-6)),
    )  # fmt: skip
    return {dataclasses.replace(s, n_layers=0): prof for s in GPU_SPECS.values()}


H100 = "NVIDIA H100 80GB HBM3"


def run_plan(specs: dict, profiles: dict, works: dict, devices: RunDevices, seed: int = 0) -> Plan:
    """``plan: auto`` as a run makes it (``rayhf.runtime.planning.auto_plan``)."""
    cost = run_cost(devices, profiles)
    if cost is None:
        return colocated_for_run(GRAPH, devices.cluster.n_devices)
    return plan_for_run(Problem(GRAPH, specs, works, cost), seed)


def test_on_gpus_auto_searches_from_the_device_profile_and_prices_its_gain():
    works = workloads(GRAPH, StepBatch(64, 128, 256, 4))
    cuda = ClusterConfig(n_devices=2, device="cuda")
    plan = run_plan(GPU_SPECS, gpu_profiles(0.05), works, RunDevices(cuda, H100))
    assert plan.source == "auto"
    assert plan.layouts != colocated_plan(GRAPH, 2).layouts, "calls of a fixed cost split"
    assert plan.estimates["auto"] < 0.9 * plan.estimates["colocated"]
    trains = {plan.layouts["actor_train"].mesh, plan.layouts["critic_train"].mesh}
    assert len(trains) == 2, "the two train calls run side by side"


def test_on_a_gpu_the_datasheet_lacks_auto_keeps_the_colocated_plan():
    works = workloads(GRAPH, StepBatch(64, 128, 256, 4))
    cuda = ClusterConfig(n_devices=2, device="cuda")
    for name in ("Tesla T4", ""):  # a kind with no entry; no GPU seen (no name)
        plan = run_plan(GPU_SPECS, gpu_profiles(0.05), works, RunDevices(cuda, name))
        assert plan.layouts == colocated_plan(GRAPH, 2).layouts and not plan.estimates


def test_a_mixture_of_experts_role_is_searched_only_on_stages_its_engines_run():
    """DeepSpeed runs no MoE model yet: the MoE actor's train call keeps ZeRO 0-1 (torch); the
    dense critic's may go to DeepSpeed's 2-3."""
    specs = {**SPECS, "actor": public_shape("qwen3-30b-a3b"), "ref": public_shape("qwen3-30b-a3b")}
    cost = AnalyticCost(parse_cluster("2x8xH100"))
    problem = Problem(GRAPH, specs, WORKS, cost)
    opened = open_stages(WORKS, auto.expert_calls(problem))
    assert auto.expert_calls(problem) == {"actor_gen", "actor_train", "ref_inf"}
    assert opened["actor_train"].zero_choices == (0, 1)
    assert opened["critic_train"].zero_choices == (0, 1, 2, 3)
    plan = auto.auto_plan(problem, time_limit=1.0).chosen.plan
    assert plan.zero.get("actor_train", 0) < 2


def test_a_lora_role_is_searched_only_on_stages_its_engines_run():
    """DeepSpeed runs adapters at ZeRO-1 and 2, not 3: a LoRA actor's train call keeps ZeRO 0-2,
    and verl's rule keeps its layouts at those stages rather than giving no plan."""
    from rayhf.models.lora import LoraConfig, with_lora

    lora = with_lora(SPECS["actor"], LoraConfig(rank=16), "models.actor.lora")
    cost = AnalyticCost(parse_cluster("1x8xH100"))
    problem = Problem(GRAPH, {**SPECS, "actor": lora}, WORKS, cost)
    assert auto.adapter_calls(problem) == {"actor_gen", "actor_train"}
    opened = open_stages(WORKS, (), auto.adapter_calls(problem))
    assert opened["actor_train"].zero_choices == (0, 1, 2)
    assert opened["critic_train"].zero_choices == (0, 1, 2, 3)
    result = auto.auto_plan(problem.with_works(opened), time_limit=1.0)
    assert result.chosen.plan.zero.get("actor_train", 0) < 3
    verl = result.baselines["verl"][0]
    assert verl.zero.get("actor_train", 0) < 3 and len(verl.layouts["actor_train"].mesh) == 8


def test_the_chosen_plan_is_reported_beside_the_baselines():
    sim = Simulation(2.0, peak_memory={0: 3e9, 1: 5e9})
    plan = Plan({}, "search")
    result = AutoPlan(
        SearchResult(plan, sim, 120, 1.5),
        {"colocated": (plan, Simulation(3.0)),
         "realhf": (plan, Simulation(4.0, over_memory=[("actor_train", 0, 9e10)]))},
    )  # fmt: skip
    assert format_auto(result).splitlines() == [
        "estimated iteration: 2.00 s (search: 120 steps in 1.5 s); peak memory per device: 5.0 GB",
        "baselines (same cost model):",
        "  colocated      3.00 s  (1.50x the plan)",
        "  realhf         4.00 s  (2.00x the plan) (does not fit memory)",
    ]


def test_a_model_too_small_for_a_baseline_gets_a_plan_and_the_baseline_is_named_absent():
    """The ReaLHF heuristic fixes pp and tp by node count: a 2-layer model cannot take pp=16, so
    the baseline is absent (not the user's error) and the search still plans."""
    from rayhf.models.hf import ModelInit, hf_config
    from rayhf.models.spec import model_spec
    from rayhf.planner.auto import auto_plan

    config = hf_config(ModelInit(hidden_size=64, n_layers=2, n_heads=4), 24, 0, 1, 2)
    tiny = {r: model_spec(config, r in ("critic", "reward")) for r in SPECS}
    works = workloads(GRAPH, StepBatch(32, 16, 12, 4))
    result = auto_plan(Problem(GRAPH, tiny, works, AnalyticCost(parse_cluster("16x8xH100"))), 0, 2)
    assert result.absent == ["realhf"] and "realhf" not in result.baselines
    assert result.chosen.simulation.feasible
    layouts = result.chosen.plan.layouts.values()
    assert layouts and all(lay.pp <= 2 for lay in layouts)
    assert "realhf     no plan" in format_auto(result)


def test_a_role_on_fewer_devices_than_the_cluster_is_told_how_many_and_why():
    from rayhf.models.hf import ModelInit, hf_config
    from rayhf.models.spec import model_spec
    from rayhf.planner.auto import device_use

    config = hf_config(ModelInit(hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2), 24, 0, 1, 2)
    tiny = {r: model_spec(config, r in ("critic", "reward")) for r in SPECS}
    cost = AnalyticCost(parse_cluster("1x8xH100"))

    def problem(n_seqs: int) -> Problem:
        return Problem(GRAPH, tiny, workloads(GRAPH, StepBatch(n_seqs, 16, 12, 1)), cost)

    half = Plan({c.name: Layout((0, 1, 2, 3), 4) for c in GRAPH.calls}, "search")
    few = device_use(problem(1), half)
    # 2 kv heads, 2 layers, 1 sequence: at most 4 devices, whatever the search wanted
    assert "  actor: 4 of 8 devices; the model takes at most tp=2 (its heads), pp=2" in few[0]
    assert all(line.endswith(": 4 devices") for line in few) and len(few) == len(tiny)
    many = device_use(problem(32), half)
    assert many and all(line.endswith("(other calls use the rest)") for line in many)
    whole = Plan({c.name: Layout(tuple(range(8)), 8) for c in GRAPH.calls}, "search")
    assert device_use(problem(32), whole) == []


def test_the_on_policy_estimates_price_the_work_of_staleness_0(monkeypatch):
    """`rayhf plan ... max_staleness=1`: the one-at-a-time and overlapped rows are searched and
    priced without the proximal forward that only the asynchronous step's train call makes."""
    cluster = parse_cluster("1x8xH100")
    ahead = {
        n: dataclasses.replace(w, forward_share=0.75) if w.kind == "train" else w
        for n, w in WORKS.items()
    }
    k1 = StepOptions(staleness=1)
    problem = Problem(GRAPH, SPECS, ahead, AnalyticCost(cluster), k1)
    chosen = auto.auto_plan(problem, time_limit=1)
    searched = []

    def same_plan(problem, *args):  # the on-policy search, on the chosen plan
        searched.append(problem.works)
        return chosen

    monkeypatch.setattr(auto, "auto_plan", same_plan)
    rows = step_estimates(problem, chosen, on_policy_works=WORKS)
    assert searched == [WORKS]
    one_by_one = StepOptions(overlap=False)

    def barrier(works) -> float:
        cost, plan = AnalyticCost(cluster), chosen.chosen.plan
        problem = Problem(GRAPH, SPECS, open_stages(works), cost, step=one_by_one)
        return simulate(problem, plan).iteration_seconds

    assert barrier(ahead) > barrier(WORKS) * 1.01, "the forward costs something"
    assert rows[1].split()[-4] == f"{barrier(WORKS):.2f}", rows[1]
