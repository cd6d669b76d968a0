"""``rayhf k8s`` (``rayhf.k8s.cli``): render then validate, and the exit code on errors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
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


def _user_without_crds(tmp_path: Path, monkeypatch, kubectl: str | None) -> None:
    """No CRD directory anywhere; ``kubectl`` (a script body) the only one on PATH, or none."""
    from rayhf.k8s import schema

    monkeypatch.delenv("RAYHF_KUBERAY_CRDS", raising=False)
    monkeypatch.setenv("RAYHF_SHARED_DIR", str(tmp_path / "no-shared"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    if kubectl is not None:
        (bin_dir / "kubectl").write_text(f"#!/bin/sh\n{kubectl}\n")
        (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    schema._crds_from_cluster.cache_clear()


@pytest.mark.slow
def test_validate_reads_kuberays_crds_from_the_cluster_through_kubectl(
    job: dict, tmp_path: Path, monkeypatch
) -> None:
    """A user without the CRD files: ``kubectl get crd ... -o yaml`` (here a script printing
    KubeRay's CRDs as the List the API server returns) gives the schemas, and a bad field is
    still found."""
    # 4 MB of CRDs: libyaml's loader and dumper, as rayhf.k8s.schema reads them (15 s in Python)
    files = sorted(CRD_DIR.glob("*.yaml"))
    crds = [d for f in files for d in yaml.load_all(f.read_text(), yaml.CSafeLoader)]
    listing = tmp_path / "list.yaml"
    items = {"apiVersion": "v1", "kind": "List", "items": crds}
    listing.write_text(yaml.dump(items, Dumper=yaml.CSafeDumper))
    args = tmp_path / "args"
    cat = shutil.which("cat")  # PATH will hold the fake kubectl alone
    _user_without_crds(tmp_path, monkeypatch, f'echo "$@" > {args}; {cat} {listing}')
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(job))
    _worker(job)["replicas"] = "two"
    bad.write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(app, ["validate", str(good), str(bad)])
    assert result.exit_code == 1, result.output
    assert f"{good}: OK (1 validated)" in result.output
    assert f"{bad}: RayJob ppo-tiny: {WORKER}.replicas: must be an integer" in result.output
    want = "get crd rayclusters.ray.io rayjobs.ray.io rayservices.ray.io -o yaml"
    assert args.read_text().strip() == want


def test_validate_without_crds_says_in_one_line_how_to_get_them(
    tmp_path: Path, monkeypatch
) -> None:
    manifest = tmp_path / "m.yaml"
    manifest.write_text("kind: ConfigMap\napiVersion: v1\n")
    _user_without_crds(tmp_path, monkeypatch, kubectl=None)
    result = CliRunner().invoke(app, ["validate", str(manifest)])
    assert isinstance(result.exception, RayhfError), result.output
    said = str(result.exception)
    assert "\n" not in said and "--crds DIR" in said and "kubectl" in said
    _user_without_crds(tmp_path / "k", monkeypatch, 'echo "error: no context" >&2; exit 1')
    result = CliRunner().invoke(app, ["validate", str(manifest)])
    assert isinstance(result.exception, RayhfError), result.output
    said = str(result.exception)
    assert "\n" not in said and "error: no context" in said and "--crds DIR" in said
