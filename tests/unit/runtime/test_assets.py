"""Everything a run needs on disk, checked before any Ray process starts
(``rayhf.runtime.assets``): a tiny PPO run's files, and the one-line errors a user can fix."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import rayhf
from rayhf.errors import RayhfError
from rayhf.graph import Call, Graph, load_graph
from rayhf.parallel.layout import Layout
from rayhf.planner.plan import Plan, colocated_plan
from rayhf.runtime.assets import (
    _check_batch,
    base_sources,
    check_engines,
    check_graph_against_config,
    check_router_replay,
    existing_dataset,
    model_specs,
    prepare_dataset,
    prepare_models,
    prepare_run,
    prepare_tokenizer,
)
from rayhf.runtime.planning import PLAN_FILE

REPO = Path(__file__).resolve().parents[3]
PPO = load_graph(REPO / "graphs" / "ppo.yaml")


def _cfg(tmp_path: Path, *overrides: str):
    data = tmp_path / "data" / "echo.parquet"
    base = [f"run_dir={tmp_path / 'run'}", f"dataset.path={data}", "cluster.n_devices=1"]
    return rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml", [*base, *overrides])


def test_a_tiny_ppo_run_gets_its_files_graph_plan_and_dataset(tmp_path: Path):
    cfg = _cfg(tmp_path)
    assert existing_dataset(cfg, PPO) is None, "rayhf plan writes nothing"
    run_dir = tmp_path / "run"
    assets = prepare_run(cfg, run_dir)
    assert assets.graph.name == "ppo" and assets.trainable == {"actor", "critic"}
    assert len(assets.dataset) == 512 and assets.eval_dataset is None  # built by the builder
    assert (assets.tokenizer_dir / "tokenizer.json").is_file()
    dirs = assets.model_dirs
    assert dirs == {"actor": run_dir / "init" / "actor", "ref": run_dir / "init" / "actor",
                    "critic": run_dir / "init" / "critic"}  # fmt: skip
    assert all((d / "config.json").is_file() for d in dirs.values())
    assert assets.specs["ref"] == assets.specs["actor"] != assets.specs["critic"]
    assert assets.specs == model_specs(cfg), "the same shapes as from the config alone"
    assert assets.plan.layouts == colocated_plan(PPO, 1).layouts and assets.plan.source == "auto"
    assert (run_dir / PLAN_FILE).is_file(), "a resumed run keeps the plan"
    found = existing_dataset(cfg, PPO)
    assert found is not None and len(found) == 512


def test_a_lora_actor_computes_its_reference_on_its_base_weights(tmp_path: Path):
    """The reference for free: ``ref: {init_from: actor}`` of a LoRA actor has no model of its
    own; its call runs on the actor, adapters off. A copy that computes otherwise keeps one."""
    lora = "models.actor.lora.rank=4"
    assets = prepare_run(_cfg(tmp_path, lora), tmp_path / "run")
    assert [(c.name, c.role) for c in assets.graph.calls if c.base] == [("ref_inf", "actor")]
    assert set(assets.model_dirs) == set(assets.specs) == {"actor", "critic"}
    assert "ref" not in assets.plan.role_layouts(assets.graph)  # no group of its own
    assert base_sources(_cfg(tmp_path), PPO) == {}  # no adapters: the copy is the reference
    for other in ("models.ref.precision=bf16", "models.ref.lora.rank=2"):
        assert base_sources(_cfg(tmp_path, lora, other), PPO) == {}, other


def test_the_tokenizer_comes_from_an_alphabet_a_path_or_the_policy_s_model(tmp_path: Path):
    cfg = _cfg(tmp_path)
    tok, where = prepare_tokenizer(cfg, tmp_path, "actor")
    assert where == tmp_path / "tokenizer" and len(tok) == 26
    no_alphabet = cfg.with_overrides({"tokenizer.alphabet": None})
    with pytest.raises(RayhfError, match=re.escape("set tokenizer.path or tokenizer.alphabet")):
        prepare_tokenizer(no_alphabet, tmp_path, "actor")  # the actor has no path either
    missing = cfg.with_overrides({"tokenizer.alphabet": None, "tokenizer.path": str(tmp_path)})
    with pytest.raises(
        RayhfError, match=f"tokenizer.path: cannot load a tokenizer from {tmp_path}"
    ):
        prepare_tokenizer(missing, tmp_path, "actor")
    model_dir = tmp_path / "model"  # a model's directory: its tokenizer beside its weights
    tok.save_pretrained(model_dir)
    (model_dir / "config.json").write_text("{}")
    from_model = cfg.with_overrides({"tokenizer.alphabet": None, "tokenizer.path": str(model_dir)})
    _, where = prepare_tokenizer(from_model, tmp_path / "run", "actor")
    assert where == tmp_path / "run" / "tokenizer", "saved alone: workers copy it to checkpoints"
    assert {f.name for f in where.iterdir()} == {f.name for f in model_dir.iterdir()} - {
        "config.json"
    }


def test_datasets_and_models_that_cannot_be_had_are_named(tmp_path: Path):
    cfg = _cfg(tmp_path)
    tok, _ = prepare_tokenizer(cfg, tmp_path, "actor")
    with pytest.raises(
        RayhfError, match=re.escape("eval_every is set but dataset.eval_path is not")
    ):
        prepare_dataset(cfg.with_overrides({"eval_every": 5}), tok, "prompts")
    train, held_out = prepare_dataset(
        cfg.with_overrides({"dataset.eval_path": str(tmp_path / "eval.parquet")}), tok, "prompts"
    )
    assert held_out is not None and len(held_out) == 256 and len(train) == 512
    assert train.texts != held_out.texts, "held-out rows come from another seed"
    not_a_model = {"models.critic": {"path": str(tmp_path), "value_head": True}}
    with pytest.raises(RayhfError, match=r"models\.critic\.path: .* is not a model directory"):
        prepare_models(cfg.with_overrides(not_a_model), tmp_path, tok)
    with pytest.raises(
        RayhfError, match=re.escape("models.ref.init_from: 'reward' is not a role with a")
    ):
        prepare_models(cfg.with_overrides({"models.ref": {"init_from": "reward"}}), tmp_path, tok)


def test_a_reward_function_needing_a_column_the_dataset_lacks_stops_the_run(tmp_path: Path):
    cfg = _cfg(tmp_path, "models.reward.function=rayhf.rewards:math_reward")
    with pytest.raises(
        RayhfError,
        match=r"reward function rayhf.rewards:math_reward needs column "
        r"'answer', which dataset file .*echo.parquet does not have",
    ):
        prepare_run(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "init").exists(), "refused before any model is written"


def test_a_token_budget_below_the_longest_sample_stops_the_run(tmp_path: Path):
    budget = {"engines.actor_train": {"engine": "torch", "max_tokens_per_microbatch": 20}}
    with pytest.raises(RayhfError, match=re.escape(
        "engines.actor_train.max_tokens_per_microbatch=20 is smaller than the longest sample "
        "(34 tokens: prompt of 18 + generation.max_new_tokens=16); raise it to at least 34"
    )):  # fmt: skip
        prepare_run(_cfg(tmp_path).with_overrides(budget), tmp_path / "run")
    ok = {"engines.actor_train": {"engine": "torch", "max_tokens_per_microbatch": 34}}
    assert prepare_run(_cfg(tmp_path).with_overrides(ok), tmp_path / "run2").graph.name == "ppo"
    with pytest.raises(
        ValueError, match="max_tokens_per_microbatch is a setting of engine 'torch'"
    ):
        _cfg(tmp_path).with_overrides(
            {"engines.actor_train": {"engine": "deepspeed", "max_tokens_per_microbatch": 64}}
        )


def _graph(*calls: Call) -> Graph:
    return Graph(name="g", inputs=["prompts"], calls=list(calls))


@pytest.mark.parametrize(
    "call,message",
    [
        (Call(name="x", role="actor", kind="inference", interface="nope"),
         "call 'x' has unknown interface 'nope' (have: "),
        (Call(name="x", role="actor", kind="train", interface="dpo"),
         "call 'x' (interface dpo) needs algorithm.name: dpo, the config has 'ppo'"),
        (Call(name="x", role="reward", kind="inference", interface="lm"),
         "call 'x' (inference, lm) runs on role 'reward', which has no model"),
    ],
)  # fmt: skip
def test_a_graph_that_does_not_fit_the_config_is_refused(tmp_path, call, message):
    with pytest.raises(RayhfError, match="^" + re.escape(f"graph 'g': {message}")):
        check_graph_against_config(_graph(call), _cfg(tmp_path))
    check_graph_against_config(PPO, _cfg(tmp_path))


def test_plans_and_engines_that_the_config_cannot_run_are_refused(tmp_path):
    wide = Plan({c.name: Layout((0, 1, 2, 3), 4) for c in PPO.calls}, "manual")
    with pytest.raises(RayhfError, match="batch_size=2 is smaller than the plan's dp=4"):
        _check_batch(_cfg(tmp_path, "batch_size=2"), wide)
    _check_batch(_cfg(tmp_path, "batch_size=4"), wide)
    plan, specs = colocated_plan(PPO, 1), model_specs(_cfg(tmp_path))
    unknown = _cfg(tmp_path, "engines.actor_gn.engine=vllm")
    with pytest.raises(
        RayhfError, match=re.escape("engines.actor_gn: graph 'ppo' has no call 'actor_gn'")
    ):
        check_engines(unknown, PPO, plan, specs)
    wrong_kind = _cfg(tmp_path, "engines.ref_inf.engine=deepspeed")
    with pytest.raises(
        RayhfError, match=r"^engines\.ref_inf\.engine: .* runs on torch, not 'deepspeed'"
    ):
        check_engines(wrong_kind, PPO, plan, specs)


@pytest.mark.parametrize(("call", "engine"), [("actor_gen", "vllm"), ("actor_train", "deepspeed")])
def test_an_engine_that_runs_no_experts_is_refused_for_a_mixture_of_experts_role(
    tmp_path, call, engine
):
    moe = "{family: mixtral, n_heads: 4, intermediate_size: 32, config: {num_local_experts: 4}}"
    cfg = _cfg(tmp_path, f"models.actor.init={moe}", f"engines.{call}.engine={engine}")
    specs = model_specs(cfg)
    assert specs["actor"].moe is not None
    want = "torch" if call == "actor_train" else "native"
    with pytest.raises(RayhfError) as info:
        check_engines(cfg, PPO, colocated_plan(PPO, 1), specs)
    assert str(info.value) == (
        f"engines.{call}: engine '{engine}' does not run Mixture-of-Experts models yet (role "
        f"'actor' is mixtral); use engine '{want}' for {call}"
    )


def test_router_replay_is_refused_for_a_dense_policy_and_for_multi_turn_rollouts(tmp_path):
    moe = "{family: qwen3_moe, n_heads: 4, n_kv_heads: 2, config: {num_experts: 4}}"
    cfg = _cfg(tmp_path, f"models.actor.init={moe}", "algorithm.router_replay=replay")
    check_router_replay(cfg, PPO, model_specs(cfg))
    dense = _cfg(tmp_path, "algorithm.router_replay=measure")
    with pytest.raises(RayhfError) as info:
        check_router_replay(dense, PPO, model_specs(dense))
    assert str(info.value) == (
        "algorithm.router_replay: measure routes a Mixture-of-Experts policy, and role 'actor' "
        "is llama; set it to off"
    )
    agent = load_graph(REPO / "graphs" / "ppo_agent.yaml")
    with pytest.raises(RayhfError, match=r"multi-turn rollouts \(call '\w+'\) do not record"):
        check_router_replay(cfg, agent, model_specs(cfg))


def test_load_balancing_losses_are_refused_where_they_cannot_run(tmp_path):
    moe = "{family: qwen3_moe, n_heads: 4, n_kv_heads: 2, config: {num_experts: 4}}"
    glm = "{family: glm4_moe, n_heads: 4, intermediate_size: 32, config: {n_routed_experts: 4}}"
    plan = colocated_plan(PPO, 1)
    on = "models.actor.optimizer.router_aux_loss=0.001"
    ok = _cfg(tmp_path, f"models.actor.init={moe}", on)
    check_engines(ok, PPO, plan, model_specs(ok))
    for init, message in (
        ("", "role 'actor' is llama, which has no experts; set it to 0"),
        (f"models.actor.init={glm}", "glm4_moe's sigmoid router balances by its correction"),
    ):
        cfg = _cfg(tmp_path, *([init] if init else []), on)
        with pytest.raises(RayhfError, match=f"^models.actor.optimizer.router_aux_loss: {message}"):
            check_engines(cfg, PPO, plan, model_specs(cfg))
    biased = _cfg(tmp_path, f"models.actor.init={glm}", "models.actor.optimizer.router_bias_rate=1")
    check_engines(biased, PPO, plan, model_specs(biased))
    softmax = _cfg(
        tmp_path, f"models.actor.init={moe}", "models.actor.optimizer.router_bias_rate=1"
    )
    with pytest.raises(RayhfError, match="softmax router has no correction bias to move"):
        check_engines(softmax, PPO, plan, model_specs(softmax))


def test_a_family_with_no_critic_class_is_refused_as_a_critic_naming_the_field(tmp_path):
    glm = "{family: glm4_moe, n_heads: 4, intermediate_size: 32, config: {n_routed_experts: 4}}"
    cfg = _cfg(tmp_path, f"models.critic.init={glm}")
    tok, _ = prepare_tokenizer(cfg, tmp_path / "run", "actor")
    with pytest.raises(RayhfError) as info:
        prepare_models(cfg, tmp_path / "run", tok)
    assert str(info.value) == (
        "models.critic.init.family: 'glm4_moe' has no sequence-classification class in "
        "transformers, so it cannot take the role's value head; use another family"
    )
