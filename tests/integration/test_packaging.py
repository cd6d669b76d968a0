"""The built wheel works where the checkout cannot be imported: installed into a folder of its
own, it runs a config that names a built-in graph from an unrelated directory. Its dependencies
come from the test environment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_overrides

pytestmark = pytest.mark.ray

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def _wheel(tmp: Path) -> Path:
    """The wheel of a copy of the sources (the build's files stay out of the checkout)."""
    src = tmp / "src"
    for folder in ("rayhf", "graphs"):  # the wheel carries graphs/ inside the package
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(REPO / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = tmp / "wheels"
    build = [*PIP, "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)]
    subprocess.run(build, check=True, timeout=300)
    (wheel,) = out.glob("rayhf-*.whl")
    with zipfile.ZipFile(wheel) as carried:
        graphs = {n.removeprefix("rayhf/") for n in carried.namelist() if n.endswith(".yaml")}
    assert graphs == {f"graphs/{p.name}" for p in (REPO / "graphs").glob("*.yaml")}
    return wheel


def test_the_wheel_runs_a_built_in_graph_from_another_directory(tmp_path):
    site = tmp_path / "site"
    install = [*PIP, "install", "--no-deps", "--no-index", "--target", str(site)]
    subprocess.run([*install, str(_wheel(tmp_path))], check=True, timeout=300)
    work = tmp_path / "elsewhere"
    work.mkdir()
    config = yaml.safe_load((REPO / "examples" / "ppo_tiny.yaml").read_text())
    assert config["graph"] == "graphs/ppo.yaml" and not (work / "graphs").exists()
    (work / "ppo.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import rayhf; print(rayhf.__file__)"],
        cwd=work, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site), "the checkout was imported"
    overrides = tiny_overrides(work / "run")
    args = [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in overrides.items()]
    run = subprocess.run(
        [sys.executable, "-m", "rayhf", "run", "ppo.yaml", *args],
        cwd=work, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    steps = (work / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(s)["step"] for s in steps] == [1, 2]
