"""What the benchmark scripts share (run from ``benchmarks/``, which is on their path)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit() -> str:
    """The short hash of the checkout's HEAD: the commit a result was measured on."""
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
    ).stdout.strip()


def write_results(
    name: str, text: str, data: object, commit: str | None = None, indent: int | None = 2
) -> None:
    """``docs/benchmarks/<name>.md`` (``text``, ending with the commit it was measured on unless
    it names it already) and ``<name>.json`` (``data``; a dict gets a ``commit`` key)."""
    commit = commit or git_commit()
    out = REPO / "docs" / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    if commit not in text:
        text = text.rstrip("\n") + f"\n\nMeasured on commit {commit}.\n"
    (out / f"{name}.md").write_text(text)
    if isinstance(data, dict):
        data = {**data, "commit": commit}
    (out / f"{name}.json").write_text(json.dumps(data, indent=indent) + "\n")
