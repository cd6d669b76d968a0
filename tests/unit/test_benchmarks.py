"""Every benchmark script still imports (they run by hand, so nothing else would notice a
module they use moving)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARKS = sorted(p for p in BENCHMARKS_DIR.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_the_benchmark_imports(path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))  # as when run: their shared _common
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # runs its imports, not its main
    assert callable(module.main)
