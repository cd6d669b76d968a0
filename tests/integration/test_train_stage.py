"""SFT and reward-model stages on Ray Train: metrics through the tracker, HF checkpoints."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, tiny_overrides
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import rayhf
from rayhf.errors import RayhfError
from rayhf.runtime.train_stage import run_train_stage

pytestmark = pytest.mark.ray


def _stage_cfg(name: str, tmp_path, **extra):
    ov = tiny_overrides(tmp_path / "run", eval_every=1, **extra)
    ov["dataset.eval_path"] = str(tmp_path / "data" / "eval.parquet")
    return rayhf.load_config(REPO / "examples" / f"{name}_tiny.yaml").with_overrides(ov)


def test_sft_stage_reports_through_the_tracker(ray_cluster, tmp_path):
    cfg = _stage_cfg("sft", tmp_path, **{"cluster.n_devices": 2})
    result = run_train_stage(cfg)
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/nll" in rows[0] and "nll" in rows[1] and "eval/nll" in rows[2]
    assert rows[2]["eval/nll"] < rows[0]["eval/nll"]  # two steps at lr 3e-3 already help
    actor = result.final_checkpoint / "actor"
    model = AutoModelForCausalLM.from_pretrained(actor, local_files_only=True)
    init = AutoModelForCausalLM.from_pretrained(result.run_dir / "init" / "actor")
    assert any(
        not a.equal(b)
        for a, b in zip(model.state_dict().values(), init.state_dict().values(), strict=True)
    )


def test_rm_stage_writes_a_reward_model_that_rayhf_run_can_load(ray_cluster, tmp_path):
    result = run_train_stage(_stage_cfg("rm", tmp_path))
    reward = result.final_checkpoint / "reward"
    model = AutoModelForSequenceClassification.from_pretrained(reward, local_files_only=True)
    assert model.config.num_labels == 1
    assert any("eval/accuracy" in m for m in result.metrics)


def test_stage_refuses_a_multi_call_graph(ray_cluster, tmp_path):
    cfg = rayhf.load_config(REPO / "examples" / "ppo_tiny.yaml").with_overrides(
        tiny_overrides(tmp_path / "run")
    )
    with pytest.raises(RayhfError, match="exactly one train call"):
        run_train_stage(cfg)
