"""Every algorithm is a graph file on the same runtime; graph mistakes are refused by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO

import rayhf
from rayhf.algorithms import InterfaceSettings
from rayhf.algorithms.grpo import GRPOActorInterface, GRPOConfig
from rayhf.config.registry import ALGORITHMS
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.runtime.assets import check_graph_against_config
from rayhf.sampling import GenerationConfig

# every registered algorithm's name, and words that name one's parts
ALGORITHM_WORDS = re.compile(
    rf"\b({'|'.join([*ALGORITHMS, 'reinforce', 'bradley', 'critic'])})\b", re.IGNORECASE
)


def test_runtime_names_no_algorithm():
    offenders = [
        f"{p.name}:{i}"
        for p in sorted((REPO / "rayhf" / "runtime").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if ALGORITHM_WORDS.search(line)
    ]
    assert offenders == []


class _TwoRankEngine:
    """Pretends to be rank ``rank`` of two: ``all_gather_object`` returns both ranks' parts."""

    def __init__(self, other: object, rank: int) -> None:
        self.other, self.rank = other, rank

    def all_gather_object(self, obj: object) -> list[object]:
        return [obj, self.other] if self.rank == 0 else [self.other, obj]


def _scored(ids: list[int], groups: list[int], scores: list[float]) -> PackedBatch:
    b = PackedBatch(ids)
    b.add("group_ids", torch.tensor(groups), [1] * len(ids))
    b.add("scores", torch.tensor(scores), [1] * len(ids))
    return b


def test_grpo_groups_are_normalized_across_dp_ranks():
    cfg = GRPOConfig(group_size=2)
    iface = GRPOActorInterface(InterfaceSettings(cfg, GenerationConfig()))
    # group 7 has one sample on each rank; group 9 both on rank 1
    rank0 = _scored([0], [7], [1.0])
    rank1 = _scored([1, 2, 3], [7, 9, 9], [0.0, 0.5, 0.5])
    part0 = (rank0.tensors["group_ids"], rank0.tensors["scores"])
    part1 = (rank1.tensors["group_ids"], rank1.tensors["scores"])
    adv0 = iface.advantages(_TwoRankEngine(part1, 0), rank0, 0)
    adv1 = iface.advantages(_TwoRankEngine(part0, 1), rank1, 1)
    std = torch.tensor([1.0, 0.0]).std().item()  # sample std of group 7
    assert adv0.tolist() == pytest.approx([0.5 / (std + cfg.eps)])
    assert adv1.tolist() == pytest.approx([-0.5 / (std + cfg.eps), 0.0, 0.0])


def _cfg(name: str, **ov):
    return rayhf.load_config(REPO / "examples" / f"{name}_tiny.yaml").with_overrides(ov)


def test_call_on_a_role_with_no_model_is_refused():
    cfg = _cfg("ppo")
    graph = rayhf.load_graph(cfg.graph_path())
    cfg = cfg.with_overrides({"models.critic": {"function": "rayhf.tasks.demo:reward"}})
    with pytest.raises(RayhfError, match=r"call 'critic_inf' .* role 'critic', which has no model"):
        check_graph_against_config(graph, cfg)


def test_graph_and_algorithm_must_match():
    cfg = _cfg("grpo", **{"algorithm": {"name": "ppo"}})
    graph = rayhf.load_graph(cfg.graph_path())
    with pytest.raises(RayhfError, match=r"call 'actor_gen' .* needs algorithm\.name: grpo"):
        check_graph_against_config(graph, cfg)
    cfg = _cfg("grpo", **{"algorithm": {"name": "rloo"}})  # a subclass of GRPO's config
    with pytest.raises(RayhfError, match=r"call 'actor_gen' .* needs algorithm\.name: grpo"):
        check_graph_against_config(graph, cfg)


def test_remap_to_missing_key_names_call_and_key(tmp_path: Path):
    graph = yaml.safe_load((REPO / "graphs" / "remax.yaml").read_text())
    graph["calls"][3]["input_remap"] = {"seq": "greedy_sequence"}
    path = tmp_path / "remax.yaml"
    path.write_text(yaml.safe_dump(graph))
    with pytest.raises(RayhfError, match="'rew_greedy_inf' input_remap maps 'seq' to 'greedy_sequ"):
        rayhf.load_graph(path)


RUNS = {
    "grpo": {"cluster.n_devices": 2, "eval_every": 2, "eval_samples": 2},
    "remax": {},
    "rloo": {},
    "gspo": {},
    # the echo reward's EOS gate scores every 4-token answer 0: no group would differ, and a
    # step refills until full (a whole dataset without one stops the run)
    "dapo": {
        "algorithm.overlong_buffer": 2,
        "models.reward.function": "rayhf.tasks.demo:digit_share_reward",
    },
    "reinforce_pp": {},
    "dpo": {"eval_every": 1},
    "rm": {"eval_every": 1},
    "sft": {"eval_every": 1},
}


def test_every_registered_algorithm_runs_here():
    """Each algorithm in the registry has its two-step run below (PPO's: test_runtime_ppo)."""
    assert set(RUNS) == set(ALGORITHMS) - {"ppo"}


@pytest.mark.ray
@pytest.mark.parametrize("name", sorted(RUNS))
def test_each_algorithm_runs_on_the_shared_runtime(ray_cluster, tmp_path, name):
    from conftest import tiny_overrides

    ov = tiny_overrides(tmp_path / "run", **RUNS[name])
    if name in ("dpo", "rm", "sft", "grpo"):
        ov["dataset.eval_path"] = str(tmp_path / "data" / "eval.parquet")
    cfg = _cfg(name, **ov)
    result = rayhf.run(cfg)
    train_rows = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in train_rows] == [1, 2]
    expect = {
        "grpo": "clip_frac",
        "rloo": "clip_frac",
        "gspo": "seq_ratio_mean",
        "dapo": "clip_frac",
        "reinforce_pp": "clip_frac",
        "remax": "greedy_reward",
        "dpo": "reward_margin",
        "rm": "accuracy",
        "sft": "nll",
    }[name]
    assert all(expect in m for m in train_rows)
    if name == "dapo":  # a step refills until its batch is full; it never trains short
        for m in train_rows:
            assert m["dynamic/rounds"] >= 1 and 0 <= m["dynamic/dropped_share"] <= 1
            assert m["dynamic/filled"] == 1.0
    if name in ("dpo", "rm", "sft"):
        evals = [m for m in result.metrics if any(k.startswith("eval/") for k in m)]
        assert [m["step"] for m in evals] == [0, 1, 2]
    if name == "grpo":  # 2 copies of each held-out prompt x a group of 4: pass@1 to pass@8
        evals = [m for m in result.metrics if "eval/pass@1" in m]
        assert [m["step"] for m in evals] == [0, 2]
        for m in evals:
            passes = [m[f"eval/pass@{k}"] for k in (1, 2, 4, 8)]
            assert 0.0 <= passes[0] <= passes[1] <= passes[2] <= passes[3] <= 1.0
            assert m["eval/pass@1"] <= m["eval/task_reward"] + 1e-6  # a score of 1 counts only
    trained = next(p for p in result.final_checkpoint.iterdir() if (p / "config.json").exists())
    assert trained.name in ("actor", "reward")


@pytest.mark.ray
@pytest.mark.slow
def test_an_algorithm_added_by_the_checklist_runs_on_the_shared_runtime(
    ray_cluster, tmp_path, monkeypatch
):
    """The checklist's steps for a new algorithm, ``toygrpo`` (``toy_algorithm``: its config,
    its interface, its ``ALGORITHM`` row): its row in the registry (patched in here, for this
    test only), its graph file, and the ``algorithm:`` union that takes its section; two steps
    on the shared runtime, whose workers build the interface the driver resolved (sent by
    value: the workers cannot import this test's module)."""
    import ray.cloudpickle
    import toy_algorithm
    from conftest import tiny_overrides
    from pydantic import TypeAdapter

    from rayhf.config import registry
    from rayhf.config.experiment import algorithm_union

    toy = toy_algorithm.ALGORITHM
    monkeypatch.setitem(registry.ALGORITHMS, toy.name, toy)
    for cls in toy.interfaces:
        monkeypatch.setitem(registry.INTERFACES, cls.name, cls)
    graph = (REPO / "graphs" / "grpo.yaml").read_text().replace("grpo_actor", "toygrpo_actor")
    assert "toygrpo_actor" in graph
    (tmp_path / "toygrpo.yaml").write_text(graph)
    section = {"name": "toygrpo", "group_size": 2}
    algorithm = TypeAdapter(algorithm_union(registry.ALGORITHMS)).validate_python(section)
    assert type(algorithm) is toy.config
    cfg = _cfg("grpo", **tiny_overrides(tmp_path / "run", graph=str(tmp_path / "toygrpo.yaml")))
    cfg = cfg.model_copy(update={"algorithm": algorithm})  # as if the union held it at import
    ray.cloudpickle.register_pickle_by_value(toy_algorithm)
    try:
        result = rayhf.run(cfg)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(toy_algorithm)
    rows = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in rows] == [1, 2]
    assert all("clip_frac" in m for m in rows)


@pytest.mark.ray
@pytest.mark.parametrize("name", ["ppo", "grpo-openai"])  # GRPO's env: test_calculator_example
def test_multi_turn_rl_runs_on_the_shared_runtime(ray_cluster, tmp_path, name):
    """Calculator trajectories train on the runtime: PPO (its critic too) through the
    environment in Llama 3's chat template, GRPO through the same task written as an
    ``openai``-client agent, which the worker serves over HTTP, in Gemma's and one step ahead
    (``max_staleness: 1``). The loss sees the model's tokens only, the trainer's log-probs of
    them are the generator's (on-policy), and the environment's metrics are logged."""
    from conftest import tiny_overrides

    from rayhf.tasks.calculator import build_tokenizer

    algo, agent = name.split("-")[0], name.endswith("openai")
    # the other two chat templates (ChatML's: test_calculator_example.py)
    build_tokenizer(tmp_path / "tok", chat_format="gemma" if agent else "llama3")
    shape = {"family": "qwen2", "hidden_size": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
             "max_positions": 512}  # fmt: skip
    models = {"actor": {"init": shape}, "ref": {"init_from": "actor"}}
    if algo == "ppo":
        models["critic"] = {"init": {**shape, "seed": 7}, "value_head": True}
    source = ({"agent": "rayhf.tasks.calculator:openai_agent"} if agent
              else {"cls": "rayhf.tasks.calculator:CalculatorEnv"})  # fmt: skip
    ov = tiny_overrides(tmp_path / "run", **{
        "graph": f"graphs/{algo}_agent.yaml",
        "tokenizer": {"path": str(tmp_path / "tok")},
        "dataset.path": str(tmp_path / "data" / "calc.parquet"),
        "dataset.max_prompt_len": 32,
        "dataset_builder": "rayhf.tasks.calculator:make_dataset",
        "env": {**source, "max_turns": 3, "max_tokens": 500},
        "generation.max_new_tokens": 12,
        "models": models,
        "cluster.n_devices": 1,
    })  # fmt: skip
    if agent:  # and one step ahead: step 2's trajectories sample while step 1 trains
        ov.update({"algorithm.max_staleness": 1, "driver.overlap_steps": True, "save_every": 2})
    result = rayhf.run(_cfg(algo, **ov))
    rows = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        # a random model never answers: every trajectory runs its 3 turns, each turn followed by
        # the nudge, so its response holds model and environment tokens; the environment's
        # budget ends it, or the agent's own (it returns 0 after 3 turns)
        assert m["turns"] == 3 and m["ended_done" if agent else "ended_turns"] == 1
        assert 0.0 <= m["generator_idle"] < 1.0
        if algo == "ppo":
            assert "value_loss" in m
    assert rows[0]["logprob_mismatch"] < 1e-3  # on-policy; step 2 is a step stale if agent
    if agent:
        assert [m["async/staleness"] for m in rows] == [0.0, 1.0]
        assert rows[1]["is_weight_mean"] > 0
    else:
        assert rows[1]["logprob_mismatch"] < 1e-3


@pytest.mark.ray
def test_a_judge_model_scores_on_the_shared_runtime(ray_cluster, tmp_path):
    """GRPO whose reward is a judge model's verdict: the judge's generate call is planned like
    the others, each verdict is parsed (a number over ``scale``) and one that does not parse
    scores ``unparsable_score`` and is counted."""
    import json

    from conftest import tiny_overrides

    shape = {"family": "llama", "hidden_size": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1}
    judge = {"template": "{prompt} {response} =", "verdict": "number", "scale": 9,
             "unparsable_score": -1.0, "max_new_tokens": 1}  # fmt: skip
    ov = tiny_overrides(tmp_path / "run", **{
        "graph": "graphs/grpo_judge.yaml",
        "models": {"actor": {"init": shape}, "ref": {"init_from": "actor"},
                   "judge": {"init": {**shape, "seed": 3}}},
        "judge": judge,
    })  # fmt: skip
    result = rayhf.run(_cfg("grpo", **ov))
    rows = [m for m in result.metrics if m["step"] > 0]
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        # one token a verdict: a digit d scores d / 9, anything else -1
        share, mean = m["batch/verdict_unparsable"], m["task_reward"]
        assert 0.0 <= share <= 1.0 and -share - 1e-6 <= mean <= 1 - 2 * share + 1e-6
    plan = json.loads((result.run_dir / "plan.json").read_text())
    assert "judge_gen" in json.dumps(plan)
    with pytest.raises(RayhfError, match=r"call 'judge_gen' .* set judge\.template"):
        check_graph_against_config(
            rayhf.load_graph(REPO / "graphs" / "grpo_judge.yaml"),
            _cfg("grpo", **{**ov, "judge": {"verdict": "number"}}),
        )
