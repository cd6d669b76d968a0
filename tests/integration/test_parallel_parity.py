"""dp x tp x pp parity against single-process Hugging Face models, on 4 emulated CPU devices,
in fp32 and bf16.

One subprocess (``python -m rayhf.checks.parity``) runs 4 gloo ranks through every precision
and every case (one per family of ``rayhf.models.families``, and ``EXTRA_CASES``), each on the
harness's covering set of layouts (dp, tp, pp in {1, 2, 4}, dp*tp*pp <= 4): dp alone and tp
with pp for every case, and one more layout that rotates over the cases, so that every layout
runs in each precision without the whole product; these tests read its rows. In bf16 the
reference is Hugging Face's own model in bf16 (frozen copies) or its fp32 model under the same
autocast (trained copies), and the tolerances are a few bf16 roundings (2**-8 relative) of the
largest value: the sums run in another order here (tp shards, packed rows), so results differ by
roundings, not by more.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from parity_support import TOLERANCES

from rayhf.checks.parity import CASES, CONTEXT_LAYOUTS, PRECISIONS, _model, covering, layouts
from rayhf.models.families import FAMILIES
from rayhf.models.sharding import param_shards, stage_layers
from rayhf.models.spec import model_spec

# the harness runs every case and precision in one subprocess (the module fixture): a minute or
# more alone on 2 cores, more when the machine is shared
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


def _assert_matches(r: dict, precision: str) -> None:
    """One rank's row within the bounds of its precision."""
    tol = TOLERANCES[precision]
    where = (
        f"{precision} {r['family']} dp{r['dp']}tp{r['tp']}pp{r['pp']}cp{r['cp']} rank {r['rank']}"
    )
    assert r["logits"] < tol.logits, f"{where}: logits off by {r['logits']:.2e}"
    assert r["scores"] < tol.logits, f"{where}: scores off by {r['scores']:.2e}"
    case = CASES.get(r["family"])  # (a registered row's is not among them)
    no_critic = case is not None and not FAMILIES[case.family].value_head_class  # GLM-4.5
    assert no_critic or r["values"] < tol.values, f"{where}: values off by {r['values']}"
    assert r["grads"] < tol.grads, f"{where}: gradients off by {r['grads']:.2e}"
    assert r["step_off"] <= tol.step_off, f"{where}: {r['step_off']:.2%} steps differ"
    # a weight off is off by at most the two opposite first steps
    bound = TOL if precision == "fp32" else 2.01 * LR
    assert r["step"] < bound, where
    assert r["moved"] > 10 * TOL, f"{where}: the optimizer step changed nothing"
    if CASES.get(r["family"]) is not None and CASES[r["family"]].zero1 and r["dp"] > 1:
        assert r["zero1_step"] < bound, f"{where}: ZeRO-1 step off by {r['zero1_step']}"
    if r.get("replay") is not None:  # a Mixture-of-Experts case's routing replay
        assert r["replay"] < tol.logits, f"{where}: replayed scores off by {r['replay']:.2e}"
        assert r["replay_moved"] > 1e-6, f"{where}: replaying other experts changed nothing"
        floor = 1.0 if precision == "fp32" else tol.same_tokens
        assert r["routes"] is None or r["routes"] >= floor, f"{where}: recorded experts"


def _assert_tokens_agree(rows: list[dict], precision: str, case: str) -> None:
    rows = [r for r in rows if r["generate"] is not None]  # (a replica that served the others)
    assert rows, f"{precision} {case}: no layout generated"
    share = sum(r["generate"] for r in rows) / len(rows)
    tol = TOLERANCES[precision]
    assert share >= tol.same_tokens, f"{precision} {case}: {share:.0%} greedy tokens agree"


@pytest.mark.parametrize("precision", sorted(TOLERANCES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_covering_layout_matches_hugging_face(rows, case, precision):
    mine = [r for r in rows if r["family"] == case and r["precision"] == precision]
    checks = covering(4, list(CASES), PRECISIONS, context=True)
    checked = [(*s, 1)[:4] for p, c, s in checks if (p, c) == (precision, case)]
    family = FAMILIES[CASES[case].family]
    splits = 1 if family.delta_net is None else 0  # a sequence split, where the family can
    assert len(checked) == 3 + (2 if family.moe is not None else 0) + splits
    for d, t, p, c in checked:
        ranks = [r for r in mine if (r["dp"], r["tp"], r["pp"], r["cp"]) == (d, t, p, c)]
        assert len(ranks) == d * t * p, f"{case} dp{d}tp{t}pp{p}cp{c}: {len(ranks)} reported"
        for r in ranks:
            _assert_matches(r, precision)
    _assert_tokens_agree(mine, precision, case)


def test_frozen_bf16_copies_hold_half_the_bytes(rows):
    """A frozen copy keeps bf16 weights; a trained one fp32 master weights."""
    for r in rows:
        ratio = 2 if r["precision"] == "bf16" else 1
        assert r["bytes"] == ratio * r["frozen_bytes"], r


def test_the_covering_set_runs_every_layout_in_each_precision_and_every_axis_for_each_case():
    """Not every product: each layout of 4 ranks for some case, each case split over dp, tp and
    pp, in each precision."""
    checks = covering(4, list(CASES), PRECISIONS, context=True)
    per_case = [
        (5 if FAMILIES[c.family].moe is not None else 3)
        + (FAMILIES[c.family].delta_net is None)  # and one with sequences split
        for c in CASES.values()
    ]
    assert len(checks) == len(TOLERANCES) * sum(per_case)  # 3 a case, 5 with experts, +1 cp
    assert len(checks) < len(CASES) * len(TOLERANCES) * len(layouts(4)) / 2
    for precision in TOLERANCES:
        assert {s for p, _, s in checks if p == precision and len(s) == 3} == set(layouts(4))
        assert {s for p, _, s in checks if p == precision and len(s) == 4} == set(CONTEXT_LAYOUTS)
        for case in CASES:
            sizes = [s for p, c, s in checks if (p, c) == (precision, case)]
            assert all(any(s[axis] > 1 for s in sizes) for axis in range(3)), (precision, case)


def _bound(family: str, tp: int, pp: int, ep: int) -> int:
    """Bytes a device may hold: the decoder layers of the largest pipeline stage split tp ways
    (stages hold whole layers: a model whose layers differ in size, MoE and dense, cuts
    unevenly) and their routed experts ep ways too, the embedding and head (which pp does not
    split) tp ways, replicated parameters (norms, some biases) whole."""
    spec = model_spec(_model(family, False).config, value_head=False)
    split_layers = [0] * (spec.n_layers + 2)
    split_ends = whole = 0
    for p in param_shards(spec):
        if p.tp_dim is None:
            whole += p.numel
        elif 1 <= p.unit <= spec.n_layers:
            split_layers[p.unit] += p.numel // ep if p.expert else p.numel
        else:
            split_ends += p.numel
    stage = max(sum(split_layers[i + 1] for i in layers) for layers in stage_layers(spec, pp))
    # tensor_split chunks differ by one row: allow one extra row per split parameter.
    slack = sum(p.numel // p.shape[p.tp_dim] for p in param_shards(spec) if p.tp_dim is not None)
    return 4 * (stage // tp + split_ends // tp + whole + slack)


@pytest.mark.parametrize("family", sorted(CASES))
def test_parameter_bytes_per_device_shrink_with_tp_pp_and_ep(rows, family):
    rows = [r for r in rows if r["precision"] == "fp32"]
    spec = model_spec(_model(family, False).config, value_head=False)
    full = 4 * sum(p.numel for p in param_shards(spec))  # fp32 master weights
    for r in rows:
        if r["family"] != family or r["tp"] * r["pp"] * r["ep"] == 1:
            continue
        bound = _bound(family, r["tp"], r["pp"], r["ep"])
        assert r["bytes"] <= bound, f"{r}: {r['bytes']} bytes > bound {bound}"
        assert r["bytes"] < full, f"{r}: a shard is not smaller than the whole model"


def test_mixture_of_experts_cases_split_their_experts_over_the_replicas(rows):
    """Each MoE case runs its dp layouts with the experts spread over the replicas, whose
    tokens travel to the experts' ranks: over every replica (ep = dp: 2 and 4) and over pairs
    of 4 (the expert gradients then summed over 2 ranks); with sequences split (cp > 1), every
    rank holds every expert."""
    moe = [r for r in rows if FAMILIES[CASES[r["family"]].family].moe is not None]
    assert all(r["ep"] == 1 for r in moe if r["cp"] > 1)
    moe = [r for r in moe if r["cp"] == 1]
    assert {r["family"] for r in moe} >= {"qwen3_moe", "mixtral"}
    assert all(r["ep"] > 1 for r in moe if r["dp"] > 1)
    assert {(r["dp"], r["ep"]) for r in moe if r["dp"] > 1} >= {(2, 2), (4, 4), (4, 2)}


def test_ranks_of_an_ep_group_that_run_unequally_often_stay_in_step(rows):
    """Rank i of an ep group runs i + 1 forwards, then serves the others' with forwards of no
    tokens; the last replica trains on an empty minibatch beside the others (fp32): the same
    logits, and the step of Hugging Face's model trained on the other replicas' rows."""
    split = [r for r in rows if r["ep"] > 1 and r["precision"] == "fp32"]
    assert {(r["dp"], r["tp"], r["pp"]) for r in split} >= {(2, 1, 1), (4, 1, 1), (2, 2, 1)}
    for r in split:
        where = f"{r['family']} dp{r['dp']}tp{r['tp']}pp{r['pp']}ep{r['ep']} rank {r['rank']}"
        assert r["turns_logits"] < TOLERANCES["fp32"].logits, where
        assert r["turns_step"] < TOL, f"{where}: the step is off by {r['turns_step']:.1e}"


# A family added as one row: Llama's traits under another name (its config class LlamaConfig,
# its configs marked "toyllama"), registered in the harness's process and sent to its ranks.
TOY_FAMILY = """
import dataclasses, sys
from rayhf.checks.parity import Case, run
from rayhf.models.families import FAMILIES, register_family
toy = dataclasses.replace(FAMILIES["llama"], hf_config_class="LlamaConfig")
register_family("toyllama", toy)
cases = {"toyllama": Case("toyllama", toy.check_shape)}
run(sys.argv[1], world=2, precisions=["fp32"], cases=cases, sizes=[(1, 2, 1), (1, 1, 2)])
"""


@pytest.mark.slow
def test_a_family_added_as_one_row_matches_hugging_face(tmp_path):
    """The parity harness runs a family that exists only as a registered row of traits: tp and
    pp on 2 ranks, fp32, within the bounds every family is held to."""
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, "-c", TOY_FAMILY, str(out)], check=True, timeout=600)
    rows = json.loads(out.read_text())
    assert sorted((r["dp"], r["tp"], r["pp"], r["rank"]) for r in rows) == [
        (1, 1, 2, 0), (1, 1, 2, 1), (1, 2, 1, 0), (1, 2, 1, 1)
    ]  # fmt: skip
    for r in rows:
        assert r["family"] == "toyllama" and r["precision"] == "fp32"
        _assert_matches(r, "fp32")
    _assert_tokens_agree(rows, "fp32", "toyllama")
