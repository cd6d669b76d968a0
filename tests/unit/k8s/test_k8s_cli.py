"""``rayhf k8s`` (``rayhf.k8s.cli``): render then validate, and the exit code on errors."""

from __future__ import annotations

from pathlib import Path

import yaml
from k8s_support import CRD_DIR, EXAMPLE, K8S_MARKS, WORKER, _worker
from k8s_support import job as job
from k8s_support import rendered as rendered
from typer.testing import CliRunner

from rayhf.errors import RayhfError
from rayhf.k8s.cli import app

pytestmark = K8S_MARKS


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
