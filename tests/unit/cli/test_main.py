"""The ``rayhf`` command (``rayhf.cli.main``): ``rayhf plan`` (in process, and twice as a
subprocess with the planner's search), one-line user errors and exit codes, and the report of
a finished run. Nothing here starts Ray."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rayhf.cli.main as cli
from rayhf.cli.main import app
from rayhf.errors import RayhfError, RunFailed, RunInterrupted
from rayhf.graph import load_graph
from rayhf.planner.cost import VLLM_KV_BYTES
from rayhf.runtime.trainer import RunResult

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"


def test_plan_prints_the_table_the_moves_and_the_memory_without_starting_anything():
    result = CliRunner().invoke(app, ["plan", str(EXAMPLE), "cluster.n_devices=2"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("plan: auto -- the plan rayhf run searches for this config")
    assert lines[1] == "plan (auto) for graph 'ppo':"
    assert lines[-1].startswith("  memory per device (weights, optimizer state, engines, largest")
    gpu = CliRunner().invoke(app, ["plan", str(EXAMPLE), "cluster.device=cuda"])
    assert "keeps the colocated plan: no GPU visible here" in gpu.output  # this machine
    assert "plan (auto) for graph 'ppo':" in gpu.output and "estimated" not in gpu.output
    colocated = CliRunner().invoke(app, ["plan", str(EXAMPLE), "plan=colocated"])
    lines = colocated.output.splitlines()
    assert lines[0] == "plan (colocated) for graph 'ppo':" and len(lines) == 2 + 6 + 2
    assert lines[-2] == "  reallocations per step: none (every call runs in its role's home layout)"
    as_json = CliRunner().invoke(app, ["plan", str(EXAMPLE), "--json", "plan=colocated"])
    assert as_json.exit_code == 0, as_json.output
    layouts = json.loads(as_json.output)
    assert set(layouts) == set(load_graph(REPO / "graphs" / "ppo.yaml").by_name)
    assert layouts["actor_gen"] == {"mesh": [0, 1], "dp": 2, "tp": 1, "pp": 1, "n_microbatches": 1}


def test_plan_on_gpus_prints_the_searched_plan_and_its_priced_gain(monkeypatch):
    """A GPU's profile injected where ``rayhf run`` would time the models on the GPU."""
    import dataclasses

    import rayhf.runtime.planning
    from rayhf.models.spec import model_spec
    from rayhf.planner.profile import ModelProfile, OpFit

    def gpu_profiles(configs):
        specs = {role: model_spec(c, value_head) for role, (c, value_head) in configs.items()}
        prof = ModelProfile(
            "injected", 0,
            forward=OpFit((0.05, 2e-7, 0.0), (0.0, 4e-8, 0.0)),
            train=OpFit((0.15, 6e-7, 0.0), (0.0, 1.2e-7, 0.0)),
            generate=OpFit((0.05, 0.0, 2e-3, 0.0), (0.0, 0.0, 4e-4, 1e-6)),
        )  # fmt: skip
        profiles = {dataclasses.replace(s, n_layers=0): prof for s in specs.values()}
        return specs, profiles, "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(rayhf.runtime.planning, "gpu_profiles", gpu_profiles)
    result = CliRunner().invoke(app, ["plan", str(EXAMPLE), "cluster.device=cuda"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert (
        lines[0].endswith("timed on this machine's GPU)")
        and lines[1] == "plan (auto) for graph 'ppo':"
    )
    meshes = {line.split()[3] for line in lines[3:9]}
    assert meshes != {"0-1"}, "not every call on both GPUs: the colocated plan is slower here"
    gain = re.search(r"estimated ([\d.]+) s a step; the colocated plan ([\d.]+) s", result.output)
    assert gain is not None and float(gain[1]) < float(gain[2])


@pytest.mark.parametrize(
    "args,message",
    [
        (["run"], "give a CONFIG file, or --resume RUN_DIR"),
        (["run", str(EXAMPLE), "--resume", "runs/x"], "--resume takes the config saved in the run"),
        (["sft", str(EXAMPLE)], "graph: `rayhf sft` runs graphs/sft.yaml, got graphs/ppo.yaml"),
        (["rm", str(EXAMPLE)], "graph: `rayhf rm` runs graphs/rm.yaml, got graphs/ppo.yaml"),
        (["plan", str(EXAMPLE), "--shape", "actr=llama2-7b"],
         "--shape 'actr=llama2-7b': write ROLE=SHAPE with ROLE one of ['actor', 'ref', 'critic', "
         "'reward']"),
    ],
)  # fmt: skip
def test_user_mistakes_are_rayhf_errors(args: list[str], message: str):
    result = CliRunner().invoke(app, args)
    assert isinstance(result.exception, RayhfError), result.output
    assert str(result.exception).startswith(message)


def _main_with(monkeypatch, capsys, app_does) -> tuple[int, str]:
    monkeypatch.setattr(cli, "app", app_does)
    with pytest.raises(SystemExit) as done:
        cli.main()
    return int(done.value.code or 0), capsys.readouterr().err


def _raise(error: BaseException):
    def app_does() -> None:
        raise error

    return app_does


@pytest.mark.parametrize(
    "error,code,printed",
    [
        (RayhfError("steps: must be > 0"), 2, "rayhf: error: steps: must be > 0\n"),
        (RunFailed("role 'actor' died"), 1, "rayhf: run stopped: role 'actor' died\n"),
        (RunInterrupted("interrupted; continue with --resume r"), 130,
         "rayhf: interrupted; continue with --resume r\n"),
        (KeyboardInterrupt(), 130, "rayhf: interrupted\n"),
    ],
)  # fmt: skip
def test_main_prints_one_line_and_exits_with_its_code(monkeypatch, capsys, error, code, printed):
    assert _main_with(monkeypatch, capsys, _raise(error)) == (code, printed)


def test_a_bug_keeps_its_traceback(monkeypatch):
    monkeypatch.setattr(cli, "app", _raise(ZeroDivisionError("bug")))
    with pytest.raises(ZeroDivisionError):
        cli.main()


def test_the_report_of_a_finished_run(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints" / "step_000002"
    metrics = [{"task_reward": 0.1}, {"task_reward": 0.875, "eval/nll": 1.5, "eval/acc": 0.25}]
    cli._report(RunResult(tmp_path, metrics, [ckpt], tmp_path / "plot.png", "actor"))
    assert capsys.readouterr().out.splitlines() == [
        f"run directory: {tmp_path}",
        f"actor checkpoint (Hugging Face format): {ckpt / 'actor'}",
        f"plot: {tmp_path / 'plot.png'}",
        "final task reward: 0.875",
        "final eval/acc: 0.2500",
        "final eval/nll: 1.5000",
    ]
    cli._report(RunResult(tmp_path, [], [], None, "actor"))
    assert capsys.readouterr().out == f"run directory: {tmp_path}\n"


def test_k8s_and_serve_are_mounted():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("run", "sft", "rm", "plan", "k8s", "serve"):
        assert command in result.output
    assert CliRunner().invoke(app, ["k8s", "--help"]).exit_code == 0


@pytest.mark.slow
def test_rayhf_plan_searches_a_cluster_and_compares_baselines(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "rayhf", "plan", str(REPO / "examples" / "ppo_tiny.yaml"),
           "--cluster", "2x8xH100", "--shape", "actor=llama2-7b", "--shape", "ref=llama2-7b",
           "--shape", "critic=llama2-7b", "--search-seconds", "3", "--gantt",
           str(tmp_path / "g.png"), "batch_size=256", "algorithm.max_staleness=1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "plan (search)" in proc.stdout and "estimated iteration" in proc.stdout
    for name in ("colocated", "disjoint", "realhf"):
        assert name in proc.stdout
    assert (tmp_path / "g.png").stat().st_size > 5000
    # the asynchronous estimate beside the synchronous ones, each on its own best plan
    ways = proc.stdout.split("each way of running steps on its own best plan:")[1]
    seconds = dict(re.findall(r"^  (\S[^\n]*?)\s+([\d.]+) s ", ways, re.M))
    assert set(seconds) == {
        "one step at a time", "overlapped (on-policy)", "asynchronous (max_staleness 1)"
    }  # fmt: skip
    assert float(seconds["one step at a time"]) >= float(seconds["overlapped (on-policy)"]) > 0


def test_rayhf_plan_shows_memory_per_device_with_the_engines(tmp_path):
    import re
    import subprocess
    import sys

    def peak(*extra: str) -> float:
        cmd = [sys.executable, "-m", "rayhf", "plan", str(REPO / "examples" / "ppo_vllm.yaml"),
               *extra]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        found = re.findall(r"d\d+ ([\d.]+) MiB", proc.stdout.split("memory per device")[1])
        return max(float(x) for x in found)

    with_engines, without = peak(), peak("engines={}")
    assert with_engines - without == pytest.approx(VLLM_KV_BYTES / 2**20, rel=0.01)


def test_run_resume_passes_safe_overrides_to_the_run(monkeypatch):
    seen = {}

    def fake_run(cfg=None, resume=None, overrides=None):
        seen.update(cfg=cfg, resume=resume, overrides=overrides)
        return RunResult(Path("r"), [], [], None, "actor", {})

    monkeypatch.setattr("rayhf.run", fake_run)
    result = CliRunner().invoke(app, ["run", "--resume", "runs/x", "steps=9", "eval_every=3"])
    assert result.exit_code == 0, result.output
    assert seen == {"cfg": None, "resume": "runs/x", "overrides": ["steps=9", "eval_every=3"]}
