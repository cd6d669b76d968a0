"""Reallocation with real processes: random layout pairs over 1-4 devices, two families.

One subprocess (``python -m rayhf.checks.reallocation``) runs 8 gloo processes (4 source, 4
destination ranks, as separate role groups are) through the sampled pairs; these tests read it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PAIRS_PER_FAMILY = 12


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("realloc") / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "rayhf.checks.reallocation",
        str(out),
        "--pairs",
        "12",
        "--seed",
        "1",
    ]
    subprocess.run(cmd, check=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gathered_destination_equals_the_source_bit_for_bit(rows, family):
    mine = [r for r in rows if r["family"] == family]
    assert len(mine) == PAIRS_PER_FAMILY
    assert {r["meshes"] for r in mine} == {"equal", "overlapping", "disjoint"}
    for r in mine:
        assert r["bit_exact"], f"{r['src']} -> {r['dst']}: weights differ after reallocation"
        assert r["logits"] < 1e-5, f"{r['src']} -> {r['dst']}: logits off by {r['logits']:.2e}"
        assert r["bytes"] > 0
