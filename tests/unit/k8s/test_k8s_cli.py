"""``rayhf k8s`` (``rayhf.k8s.cli``): render then validate, and the exit code on errors."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rayhf.errors import RayhfError
from rayhf.k8s.cli import app
from rayhf.k8s.render import render

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("RAYHF_SHARED_DIR", REPO / ".." / "shared"))
CRD_DIR = SHARED / "kuberay-crds" / "v1.7.0"
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"
CHECKPOINT = "/mnt/rayhf/runs/ppo-tiny/checkpoints/step_000120/actor"

# CI always has shared/ beside the clone: there a missing CRD folder is a failure, not a skip
if os.environ.get("CI") and not CRD_DIR.is_dir():
    raise RuntimeError(f"KubeRay CRDs not found at {CRD_DIR}; set RAYHF_SHARED_DIR")

pytestmark = [
    pytest.mark.skipif(
        not CRD_DIR.is_dir(), reason=f"KubeRay CRDs not found at {CRD_DIR} (set RAYHF_SHARED_DIR)"
    ),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),  # Ray Serve's pydantic use
]


@pytest.fixture(scope="session")
def rendered() -> list[dict]:
    return render(
        EXAMPLE, "2x8xH100", "me/rayhf:1", checkpoint=CHECKPOINT, storage_claim="rayhf-storage"
    )


@pytest.fixture
def job(rendered: list[dict]) -> dict:
    return copy.deepcopy(next(d for d in rendered if d["kind"] == "RayJob"))


WORKER = "spec.rayClusterSpec.workerGroupSpecs[0]"


def _worker(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def test_cli_render_then_validate(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", str(EXAMPLE), "--cluster", "1x2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 3 and (out / "rayjob-ppo-tiny.yaml").is_file()
    result = runner.invoke(app, ["validate", str(out), "--crds", str(CRD_DIR)])
    assert result.exit_code == 0, result.output
    assert f"{out / 'rayjob-ppo-tiny.yaml'}: OK (1 validated)" in result.output
    assert "skipped 1 ConfigMap" in result.output


def test_cli_validate_reports_errors_and_exit_code(job: dict, tmp_path: Path) -> None:
    _worker(job)["replicas"] = "two"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(app, ["validate", str(bad), "--crds", str(CRD_DIR)])
    assert result.exit_code == 1
    assert f"{bad}: RayJob ppo-tiny: {WORKER}.replicas: must be an integer" in result.output
    result = CliRunner().invoke(
        app, ["validate", str(tmp_path / "missing.yaml"), "--crds", str(CRD_DIR)]
    )
    assert isinstance(result.exception, RayhfError) and "no such file" in str(result.exception)
