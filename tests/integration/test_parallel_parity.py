"""dp x tp x pp parity against single-process Hugging Face models, on 4 emulated CPU devices,
in fp32 and bf16.

One subprocess (``python -m rayhf.checks.parity``) runs 4 gloo ranks through every precision,
every family and every layout with dp, tp, pp in {1, 2, 4} and dp*tp*pp <= 4; these tests read
its rows. In bf16 the reference is Hugging Face's own model in bf16 (frozen copies) or its fp32
model under the same autocast (trained copies), and the tolerances are a few bf16 roundings
(2**-8 relative) of the largest value: the sums run in another order here (tp shards, packed
rows), so results differ by roundings, not by more.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from parity_support import TOLERANCES

from rayhf.checks.parity import FAMILY_SHAPES, _model, layouts
from rayhf.models.sharding import param_shards
from rayhf.models.spec import model_spec

# the harness runs every family, layout and precision in one subprocess (the module fixture):
# minutes alone on 2 cores, more when the machine is shared
pytestmark = pytest.mark.timeout(1500)

LR = 1e-4  # the harness's AdamW learning rate: a first step moves each weight by about this


TOL = 1e-5


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity") / "rows.json"
    subprocess.run(
        [sys.executable, "-m", "rayhf.checks.parity", str(out), "--world", "4"],
        check=True,
        timeout=1500,
    )
    return json.loads(out.read_text())


@pytest.mark.parametrize("precision", sorted(TOLERANCES))
@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_every_layout_matches_hugging_face(rows, family, precision):
    tol = TOLERANCES[precision]
    mine = [r for r in rows if r["family"] == family and r["precision"] == precision]
    expected = {(d, t, p): d * t * p for d, t, p in layouts(4)}
    assert len(expected) == 10
    for (d, t, p), n_ranks in expected.items():
        ranks = [r for r in mine if (r["dp"], r["tp"], r["pp"]) == (d, t, p)]
        assert len(ranks) == n_ranks, f"{family} dp{d}tp{t}pp{p}: {len(ranks)} ranks reported"
        for r in ranks:
            where = f"{precision} {family} dp{d}tp{t}pp{p} rank {r['rank']}"
            assert r["logits"] < tol.logits, f"{where}: logits off by {r['logits']:.2e}"
            assert r["scores"] < tol.logits, f"{where}: scores off by {r['scores']:.2e}"
            assert r["values"] < tol.values, f"{where}: values off by {r['values']:.2e}"
            assert r["grads"] < tol.grads, f"{where}: gradients off by {r['grads']:.2e}"
            assert r["step_off"] <= tol.step_off, f"{where}: {r['step_off']:.2%} steps differ"
            # a weight off is off by at most the two opposite first steps
            assert r["step"] < (TOL if precision == "fp32" else 2.01 * LR), where
            assert r["moved"] > 10 * TOL, f"{where}: the optimizer step changed nothing"
            if family == "llama" and d > 1:
                bound = TOL if precision == "fp32" else 2.01 * LR
                assert r["zero1_step"] < bound, f"{where}: ZeRO-1 step off by {r['zero1_step']}"
    share = sum(r["generate"] for r in mine) / len(mine)
    assert share >= tol.same_tokens, f"{precision} {family}: {share:.0%} greedy tokens agree"


def test_frozen_bf16_copies_hold_half_the_bytes(rows):
    """A frozen copy keeps bf16 weights; a trained one fp32 master weights."""
    for r in rows:
        ratio = 2 if r["precision"] == "bf16" else 1
        assert r["bytes"] == ratio * r["frozen_bytes"], r


def _bound(family: str, tp: int, pp: int) -> int:
    """Bytes a device may hold: decoder layers split tp*pp ways, the embedding and head (which
    pp does not split) tp ways, replicated parameters (norms, some biases) whole."""
    spec = model_spec(_model(family, False).config, value_head=False)
    split_layers = split_ends = whole = 0
    for p in param_shards(spec):
        if p.tp_dim is None:
            whole += p.numel
        elif 1 <= p.unit <= spec.n_layers:
            split_layers += p.numel
        else:
            split_ends += p.numel
    # tensor_split chunks differ by one row: allow one extra row per split parameter.
    slack = sum(p.numel // p.shape[p.tp_dim] for p in param_shards(spec) if p.tp_dim is not None)
    return 4 * (split_layers // (tp * pp) + split_ends // tp + whole + slack)


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_parameter_bytes_per_device_shrink_with_tp_and_pp(rows, family):
    rows = [r for r in rows if r["precision"] == "fp32"]
    full = next(r["bytes"] for r in rows if r["family"] == family and r["tp"] * r["pp"] == 1)
    for r in rows:
        if r["family"] != family or r["tp"] * r["pp"] == 1:
            continue
        bound = _bound(family, r["tp"], r["pp"])
        assert r["bytes"] <= bound, f"{r}: {r['bytes']} bytes > bound {bound}"
        assert r["bytes"] < full, f"{r}: a shard is not smaller than the whole model"
