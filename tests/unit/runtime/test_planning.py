"""From an experiment config to the planner's inputs (``rayhf.runtime.planning``): workloads as
``rayhf run``, ``rayhf plan`` and ``plan: auto`` price them, and the plan a run keeps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import rayhf
from rayhf.engines.config import TorchEngineConfig, VllmEngineConfig
from rayhf.graph import load_graph
from rayhf.parallel.layout import Layout
from rayhf.planner.cost import Workload
from rayhf.planner.plan import Plan, colocated_plan, plan_from_json
from rayhf.runtime.planning import (
    PLAN_FILE,
    auto_plan,
    call_engines,
    planner_workloads,
    prompt_tokens,
)

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"
GRAPH = load_graph(REPO / "graphs" / "ppo.yaml")


def test_the_config_s_batch_lengths_and_minibatches_are_priced():
    cfg = rayhf.load_config(EXAMPLE)  # batch 64, prompts <= 24, 16 new tokens, 4 minibatches
    assert prompt_tokens(cfg, None) == 24, "no dataset yet: the config's bound"
    dataset = SimpleNamespace(mean_prompt_len=lambda: 9.6)
    assert prompt_tokens(cfg, dataset) == 10  # type: ignore[arg-type]
    works = planner_workloads(cfg, GRAPH, None)
    assert works["actor_gen"] == Workload("generate", 64, 24, 16, 1)
    assert works["ref_inf"] == Workload("inference", 64, 24, 16, 1)
    assert works["actor_train"] == Workload("train", 64, 24, 16, 4)


def test_groups_epochs_and_the_proximal_forward_are_priced_as_the_interfaces_run_them():
    """GRPO samples group_size responses a prompt: every call sees that many sequences; a
    train call goes over its minibatches ppo_epochs times; at max_staleness > 0 the policy's
    train call also forwards what its first minibatch does not give of the proximal log-probs."""
    grpo = rayhf.load_config(REPO / "examples" / "grpo_tiny.yaml")  # 16 prompts x 4, 4 mbs
    graph = load_graph(REPO / "graphs" / "grpo.yaml")
    works = planner_workloads(grpo, graph, None)
    assert {w.n_seqs for w in works.values()} == {64}
    assert works["actor_train"].forward_share == 0 and works["actor_train"].epochs == 1
    ahead = planner_workloads(grpo.with_overrides({"algorithm.max_staleness": 1}), graph, None)
    assert ahead["actor_train"].forward_share == 3 / 4
    assert ahead["actor_gen"] == works["actor_gen"] and ahead["ref_inf"] == works["ref_inf"]
    ppo = rayhf.load_config(EXAMPLE, ["algorithm.max_staleness=2", "algorithm.ppo_epochs=2"])
    works = planner_workloads(ppo, GRAPH, None)
    assert works["actor_train"].n_seqs == 64 and works["actor_train"].epochs == 2
    assert works["actor_train"].forward_share == 1, "with 2 epochs all of it, up front"
    assert works["critic_train"].epochs == 2 and works["critic_train"].forward_share == 0


def test_engines_and_zero1_reach_the_workloads():
    cfg = rayhf.load_config(
        EXAMPLE,
        ["engines.actor_gen.engine=vllm", "models.actor.optimizer.zero1=true"],
    )
    engines = call_engines(cfg, GRAPH)
    assert engines["actor_gen"] == VllmEngineConfig()
    assert engines["critic_train"] == TorchEngineConfig()
    works = planner_workloads(cfg, GRAPH, None)
    assert works["actor_gen"].engine == VllmEngineConfig() and works["actor_gen"].whole_model_ranks
    assert works["actor_train"].zero_stage == 1 and works["critic_train"].zero_stage == 0


def test_a_resumed_run_keeps_its_plan_while_it_fits(tmp_path):
    cfg = rayhf.load_config(EXAMPLE, ["cluster.n_devices=2"])
    kept = Plan({c.name: Layout((1,), 1) for c in GRAPH.calls}, "auto")
    (tmp_path / PLAN_FILE).write_text(kept.to_json())
    assert auto_plan(cfg, GRAPH, {}, None, tmp_path) == kept  # type: ignore[arg-type]


def test_a_plan_that_no_longer_fits_is_made_again_and_kept(tmp_path):
    cfg = rayhf.load_config(EXAMPLE, ["cluster.n_devices=1"])  # one device: nothing to search
    stale = Plan({c.name: Layout((1,), 1) for c in GRAPH.calls}, "auto")
    (tmp_path / PLAN_FILE).write_text(stale.to_json())
    plan = auto_plan(cfg, GRAPH, {}, None, tmp_path)  # type: ignore[arg-type]
    assert plan.source == "auto" and plan.layouts == colocated_plan(GRAPH, 1).layouts
    assert plan_from_json((tmp_path / PLAN_FILE).read_text(), "auto") == plan
    other_graph = Plan({"train": Layout((0,), 1)}, "auto")
    (tmp_path / PLAN_FILE).write_text(other_graph.to_json())
    assert auto_plan(cfg, GRAPH, {}, None, tmp_path) == plan  # type: ignore[arg-type]


def test_multi_turn_calls_are_priced_by_their_turns_and_need_a_dp_layout():
    """With an env, a sequence holds up to max_turns turns of max_new_tokens (within
    env.max_tokens); its generate call decodes what trajectories send as they send it, so a tp
    or pp layout for it is refused in one line."""
    from rayhf.errors import RayhfError
    from rayhf.runtime.assets import _check_env_layouts

    grpo = rayhf.load_config(REPO / "examples" / "grpo_tiny.yaml")  # prompts <= 24, 16 new
    graph = load_graph(REPO / "graphs" / "grpo_agent.yaml")
    env = {"env": {"cls": "rayhf.tasks.calculator:CalculatorEnv", "max_turns": 3}}
    works = planner_workloads(grpo.with_overrides(env), graph, None)
    assert works["actor_gen"].gen_len == 48 and works["actor_train"].gen_len == 48
    capped = grpo.with_overrides({**env, "env": {**env["env"], "max_tokens": 40}})
    assert planner_workloads(capped, graph, None)["ref_inf"].gen_len == 40 - 24
    plan = colocated_plan(graph, 2)
    _check_env_layouts(graph, plan)  # dp only: fine
    layouts = {**plan.layouts, "actor_gen": Layout(mesh=(0, 1), dp=1, tp=2)}
    with pytest.raises(RayhfError, match=r"call 'actor_gen' runs an environment.*tp = 2, pp = 1"):
        _check_env_layouts(graph, Plan(layouts, "manual"))


def test_a_judge_is_priced_reading_each_answer_and_writing_its_verdict():
    """The judge's generate call reads every sample's prompt and response and writes
    judge.max_new_tokens, not the policy's generation length."""
    cfg = rayhf.load_config(REPO / "examples" / "judge" / "grpo.yaml")  # 24 + 16, 64 new tokens
    graph = load_graph(REPO / "examples" / "judge" / "grpo_judge_with_task_score.yaml")
    works = planner_workloads(cfg, graph, None)
    assert works["actor_gen"] == Workload("generate", 64, 24, 16, 1)
    assert works["judge_gen"] == Workload("generate", 64, 24 + 16, 64, 1)
    longer = planner_workloads(cfg.with_overrides({"judge.max_new_tokens": 8}), graph, None)
    assert longer["judge_gen"].gen_len == 8
