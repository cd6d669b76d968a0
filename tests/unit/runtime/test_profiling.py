"""Measuring a model for the planner (``rayhf.runtime.profiling``): the engine's times are
measured, fitted and cached, and ``plan: auto`` searches with them on emulated CPU devices."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import LlamaConfig

from rayhf.graph import load_graph
from rayhf.models.hf import ModelInit, hf_config
from rayhf.models.spec import model_spec
from rayhf.parallel.layout import Layout
from rayhf.planner.auto import (
    RunDevices,
    StepBatch,
    colocated_for_run,
    plan_for_run,
    run_cost,
    workloads,
)
from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.hardware import cpu_cluster
from rayhf.planner.plan import Plan, colocated_plan
from rayhf.planner.problem import Problem
from rayhf.planner.profile import ProfiledCost
from rayhf.runtime.profiling import _engine, _period, _with_depth, profile_model, profiles_for

REPO = Path(__file__).resolve().parents[3]
GRAPH = load_graph(REPO / "graphs" / "ppo.yaml")


def tiny(value_head: bool = False):
    config = LlamaConfig(
        vocab_size=26, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=176, max_position_embeddings=128,
    )  # fmt: skip
    return config, model_spec(config, value_head)


def test_profile_is_measured_fitted_and_cached(tmp_path):
    config, spec = tiny()
    prof = profile_model(config, False, threads=1, cache=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and files[0].stem == prof.key
    for op in ("forward", "train", "generate"):
        fit = getattr(prof, op)
        assert min(fit.base + fit.layer) >= 0.0, "fitted times never shrink as work grows"
        assert sum(fit.base) + sum(fit.layer) > 0.0, f"{op} measured nothing"
    cost = ProfiledCost(cpu_cluster(2, 4.0), {dataclasses.replace(spec, n_layers=0): prof})
    small = Layout((0,), 1)
    work = workloads(GRAPH, StepBatch(8, 12, 8, 1))
    big = workloads(GRAPH, StepBatch(64, 12, 8, 1))
    for call in ("actor_gen", "ref_inf", "actor_train"):
        assert (
            cost.call(spec, small, big[call]).seconds > cost.call(spec, small, work[call]).seconds
        )
    files[0].write_text(files[0].read_text().replace(prof.key, "from-the-cache"))
    assert profile_model(config, False, threads=1, cache=tmp_path).key == "from-the-cache"


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gpt2"])
def test_a_shape_is_profiled_at_one_and_two_layers_whatever_its_per_layer_lists(family):
    """Qwen2's and Gemma's configs carry a per-layer list (``layer_types``) that Hugging Face
    checks against the depth when it saves them; the profiled depths cut it (an engine of a
    Qwen2 shape at one layer failed to build on a cold profile cache)."""
    heads = {} if family == "gpt2" else {"n_kv_heads": 2}
    config = hf_config(ModelInit(family=family, hidden_size=64, n_layers=4, n_heads=4, **heads),
                       26, 0, 1, 2)  # fmt: skip
    whole = model_spec(config, False)
    for depth in (1, 2):
        engine = _engine(_with_depth(config, depth), value_head=False)
        windows = whole.window_layers and tuple(i for i in whole.window_layers if i < depth)
        assert engine.model.spec == dataclasses.replace(
            whole, n_layers=depth, window_layers=windows
        )


def test_a_hybrid_is_profiled_over_whole_periods_of_its_layer_kinds():
    """A Qwen3.5 shape's DeltaNet layers cost unlike its attention layer: one fitted "layer" is
    their mean over a period (three DeltaNet, one attention), not a DeltaNet layer alone."""
    linear, full = "linear_attention", "full_attention"
    init = ModelInit(family="qwen3_5_text", hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2,
                     config={"layer_types": [linear] * 3 + [full]})  # fmt: skip
    config = hf_config(init, 26, 0, 1, 2)
    assert _period(config) == 4
    deeper = _with_depth(config, 8)
    assert deeper.layer_types == ([linear] * 3 + [full]) * 2
    spec = _engine(deeper, value_head=False).model.spec
    assert spec.n_layers == 8 and spec.delta_layers == (0, 1, 2, 4, 5, 6)
    assert _period(hf_config(ModelInit(family="gemma2", hidden_size=64, n_layers=4, n_heads=4,
                                       n_kv_heads=2), 26, 0, 1, 2)) == 1  # fmt: skip


def test_auto_plan_on_two_cpu_devices_is_valid_and_reproducible(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYHF_CACHE_DIR", str(tmp_path))
    actor, _ = tiny()
    critic, _ = tiny(value_head=True)
    configs = {"actor": (actor, False), "ref": (actor, False), "critic": (critic, True)}
    works = workloads(GRAPH, StepBatch(32, 13, 12, 4))
    cluster = ClusterConfig(n_devices=2)
    specs, profiles = profiles_for(configs, threads=1)

    def run_plan(cluster: ClusterConfig, seed: int = 0) -> Plan:
        cost = run_cost(RunDevices(cluster), profiles)
        if cost is None:
            return colocated_for_run(GRAPH, cluster.n_devices)
        return plan_for_run(Problem(GRAPH, specs, works, cost), seed)

    first = run_plan(cluster, seed=1)
    again = run_plan(cluster, seed=1)
    assert first.layouts == again.layouts and first.source == "auto"
    assert first.layouts and all(set(lay.mesh) <= {0, 1} for lay in first.layouts.values())
    assert list((tmp_path / "profiles").glob("*.json")), "profiles are cached"
    one = run_plan(ClusterConfig(n_devices=1))
    assert one.layouts == colocated_plan(GRAPH, 1).layouts
