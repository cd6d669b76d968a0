"""Reallocation with real processes: a covering set of layout pairs over 1-4 devices (every
class of move over every transport, ``COVERING`` pairs a family), three families (Qwen3-MoE's
experts move between ep shares too), every rank of every destination replica checked.

One subprocess (``python -m rayhf.checks.reallocation``) runs 8 gloo processes (4 source, 4
destination ranks, as separate role groups are) through the sampled pairs; these tests read it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rayhf.checks.reallocation import COVERING, FAMILIES, TRANSPORTS, _model, classes_for
from rayhf.models.spec import model_spec


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("realloc") / "rows.json"
    cmd = [sys.executable, "-m", "rayhf.checks.reallocation", str(out)]
    cmd += ["--pairs", str(COVERING), "--seed", "1"]
    subprocess.run(cmd, check=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_every_destination_rank_equals_the_source_bit_for_bit(rows, family):
    mine = [r for r in rows if r["family"] == family]
    assert len(mine) == COVERING
    # expand, shrink, equal/overlapping/disjoint, tp<->pp, ZeRO-3 (MoE: an ep change), relay
    for c in classes_for(model_spec(_model(family).config, value_head=False)):
        for t in TRANSPORTS:
            assert any(c in r["classes"] and r["transport"] == t for r in mine), f"no {c} on {t}"
    for r in mine:
        pair = f"{r['src']} -> {r['dst']} (flat source: {r['flat']})"
        assert r["bit_exact"], f"{pair}: a destination rank's weights differ"
        assert r["gathered_exact"], f"{pair}: the model gathered from a replica differs"
        assert r["ranks_checked"] == r["dst"][1] * r["dst"][2] * r["dst"][3], pair
        assert r["dst"][4] == 1 or family == "qwen3_moe", pair  # ep: experts only
        assert r["replicas_checked"] == r["dst"][1], pair
        assert r["logits"] < 1e-5, f"{pair}: logits off by {r['logits']:.2e}"
        assert r["bytes"] > 0
    if family == "qwen3_moe":  # a layout in Megatron's rank order (``stage_major``) too
        assert any(sorted(r[end][0]) != r[end][0] for r in mine for end in ("src", "dst"))


@pytest.mark.parametrize("family", FAMILIES)
def test_pairs_move_over_gloo_through_shared_memory_and_gpu_segments_alike(rows, family):
    mine = [r for r in rows if r["family"] == family]
    shm = [r for r in mine if r["transport"] == "shm"]
    gloo = [r for r in mine if r["transport"] == "gloo"]
    ipc = [r for r in mine if r["transport"] == "ipc"]
    assert len(shm) == len(gloo) == len(ipc) == COVERING // len(TRANSPORTS)
    assert all(r["shm_messages"] > 0 and r["ipc_messages"] == 0 for r in shm), "all /dev/shm"
    assert all(r["shm_messages"] == r["ipc_messages"] == 0 for r in gloo)
    # ranks on the same (stand-in) GPU use its segments, the others /dev/shm, in one move
    assert sum(r["ipc_messages"] > 0 for r in ipc) >= len(ipc) // 2
    both = [r for r in ipc if r["ipc_messages"] > 0 and r["shm_messages"] > 0]
    assert len(both) >= 3
    assert any(r["relayed"] for r in shm), "relays forward through shared memory too"
    assert any(r["relayed"] for r in both), "and across both kinds of segment"
