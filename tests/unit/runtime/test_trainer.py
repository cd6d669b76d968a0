"""The step loop's pure parts (``rayhf.runtime.trainer``): which sequences count as tokens, the
metrics of a step, what a run leaves behind, and which runs may start or resume (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rayhf
from rayhf.config import dump_config
from rayhf.data.batch import PackedBatch
from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.realloc.mover import ReallocStats
from rayhf.runtime.checkpoint import write_checkpoint
from rayhf.runtime.driver import StepOutcome
from rayhf.runtime.trainer import (
    CONFIG_FILE,
    RunResult,
    _open_run,
    sample_means,
    sequence_keys,
    step_metrics,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "graph,keys",
    [("ppo", {"seq"}), ("grpo", {"seq"}), ("sft", {"seq"}), ("dpo", {"chosen", "rejected"}),
     ("rm", {"chosen", "rejected"})],
)  # fmt: skip
def test_sequence_keys_are_what_the_train_calls_learn_from(graph: str, keys: set[str]):
    assert sequence_keys(load_graph(REPO / "graphs" / f"{graph}.yaml")) == keys


def _batch() -> PackedBatch:
    return PackedBatch(
        [0, 1],
        {
            "seq": torch.arange(7),
            "scores": torch.tensor([1.0, 0.0]),
            "prompt_lens": torch.tensor([2, 2]),
            "logprobs": torch.zeros(4),
        },
        {"seq": [3, 4], "scores": [1, 1], "prompt_lens": [1, 1], "logprobs": [2, 2]},
    )


def test_sample_means_are_of_per_sample_floats_only():
    assert sample_means(_batch()) == {"batch/scores": 0.5}
    assert sample_means(PackedBatch([])) == {}


def test_a_step_s_metrics_split_its_time_and_count_its_tokens():
    outcome = StepOutcome(
        _batch(),
        stats={"actor/loss": 1.0},
        compute_seconds={"actor_gen": 0.5, "actor_train": 0.25},
        reallocs={"actor_gen": ReallocStats(0.125, 4096)},
    )
    assert step_metrics(outcome, 2.0, {"seq", "chosen"}) == {
        "actor/loss": 1.0,
        "seconds/actor_gen": 0.5,
        "seconds/actor_train": 0.25,
        "realloc_seconds/actor_gen": 0.125,
        "realloc_bytes/actor_gen": 4096.0,
        "realloc_seconds": 0.125,
        "step_seconds": 2.0,
        "overhead_seconds": 1.125,
        "batch/scores": 0.5,
        "tokens_per_s": 3.5,
    }
    quick = step_metrics(StepOutcome(_batch(), compute_seconds={"a": 1.0}), 0.0, {"seq"})
    assert quick["overhead_seconds"] == 0.0 and quick["tokens_per_s"] == 0.0
    assert "realloc_seconds" not in quick


def test_a_run_s_policy_checkpoint_is_its_last_checkpoint_s_policy_role(tmp_path: Path):
    ckpts = [tmp_path / "step_000002", tmp_path / "step_000004"]
    done = RunResult(tmp_path, [], ckpts, None, "actor")
    assert done.final_checkpoint == ckpts[-1]
    assert done.policy_checkpoint == ckpts[-1] / "actor"
    assert RunResult(tmp_path, [], [], None, "actor").policy_checkpoint is None


def test_which_runs_start_and_which_resume(tmp_path: Path):
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml", [f"run_dir={tmp_path / 'run'}"])
    assert _open_run(cfg, None) == (cfg, tmp_path / "run", None)
    with pytest.raises(RayhfError, match="not a run directory"):
        _open_run(None, tmp_path / "run")
    (tmp_path / "run").mkdir()
    dump_config(cfg, tmp_path / "run" / CONFIG_FILE)
    with pytest.raises(RayhfError, match="no complete checkpoint to resume from"):
        _open_run(None, tmp_path / "run")
    ckpt = write_checkpoint(tmp_path / "run", 2, lambda tmp: None, {})
    saved, run_dir, found = _open_run(None, str(tmp_path / "run"))
    assert (saved, run_dir, found) == (cfg, tmp_path / "run", ckpt)
    with pytest.raises(RayhfError, match="already holds a run; continue it with --resume"):
        _open_run(cfg, None)
