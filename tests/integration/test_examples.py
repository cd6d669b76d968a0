"""Every shipped example config loads, and the driver-script example runs end to end."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from conftest import REPO, tiny_overrides

import rayhf

EXAMPLE_CONFIGS = sorted(
    p for p in (REPO / "examples").rglob("*.yaml") if "models" in yaml.safe_load(p.read_text())
)
EXAMPLE_GRAPHS = sorted(
    p for p in (REPO / "examples").rglob("*.yaml") if "calls" in yaml.safe_load(p.read_text())
)


def test_examples_are_found():
    assert len(EXAMPLE_CONFIGS) >= 9 and EXAMPLE_GRAPHS


GRAPHS = sorted((REPO / "graphs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_GRAPHS + GRAPHS)
def test_graph_files_load(path):
    assert rayhf.load_graph(path).order


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_example_configs_load_and_plan(path):
    cfg = rayhf.load_config(path)
    if cfg.plan == "auto":  # its search needs the run's models: tests/integration/test_runtime_ppo
        cfg = cfg.with_overrides({"plan": "colocated"})
    plan = rayhf.make_plan(cfg)
    graph = rayhf.load_graph(cfg.graph_path())
    assert set(plan.layouts) == {c.name for c in graph.calls}


@pytest.mark.ray
def test_driver_script_runs(ray_cluster, tmp_path):
    ov = tiny_overrides(tmp_path / "run", **{"cluster.address": ray_cluster})
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "ppo_driver.py"),
            *[f"{k}={v}" for k, v in ov.items()],
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "actor_gen" in proc.stdout and "steps: 2" in proc.stdout
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "actor" / "config.json").is_file()


RECIPES = {  # recipe -> the `rayhf plan` arguments its header gives (the models are not here)
    "grpo_qwen2.5_1.5b_gsm8k_1gpu.yaml": ["--shape", "actor=qwen2.5-1.5b", "--cluster", "1x1xH100"],
    "ppo_qwen2.5_7b_gsm8k_16x8.yaml": ["--shape", "actor=qwen2.5-7b", "--shape",
                                       "critic=qwen2.5-7b", "--cluster", "16x8xH100"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(RECIPES))
def test_the_real_model_recipes_plan_on_their_clusters(name):
    from typer.testing import CliRunner

    from rayhf.cli.main import app

    path = REPO / "examples" / "recipes" / name
    assert all(arg in path.read_text() for arg in RECIPES[name]), "the header says how to plan it"
    args = ["plan", str(path), *RECIPES[name], "--search-seconds", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    searched = result.output.split("baselines")[0]
    assert "estimated iteration:" in searched and "does not fit" not in searched
