"""Every benchmark script still imports (they run by hand, so nothing else would notice a
module they use moving), and the parts that decide what a result says work."""

from __future__ import annotations

import importlib.util
import itertools
import json
import re
from pathlib import Path

import pytest

BENCHMARKS_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
BENCHMARKS = sorted(p for p in BENCHMARKS_DIR.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.stem)
def test_the_benchmark_imports(path, monkeypatch):
    assert callable(_load(path, monkeypatch).main)  # its imports ran, not its main


def _load(path: Path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS_DIR))  # as when run: their shared _common
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_headroom_places_roles_once_per_symmetry_class(monkeypatch):
    """planner_headroom's placements: one per class of placements that swapping the halves of
    any block makes alike, checked against every placement of 3 roles on 4 devices."""
    headroom = _load(BENCHMARKS_DIR / "planner_headroom.py", monkeypatch)
    nodes = [(s, n) for n in (4, 2, 1) for s in range(0, 4, n)]

    def shape(where: dict, start: int, size: int):  # alike placements have the same shape
        here = tuple(sorted(k for k, v in where.items() if v == (start, size)))
        if size == 1:
            return (here,)
        half = size // 2
        return (here, *sorted([shape(where, start, half), shape(where, start + half, half)]))

    classes = {
        shape(dict(zip("abc", combo, strict=True)), 0, 4)
        for combo in itertools.product(nodes, repeat=3)
    }
    placed = headroom.placements(2, frozenset("abc"))
    assert len(placed) == len(classes)
    seen = set()
    for tree in placed:
        devices = headroom.blocks_of(tree, 0, 4)
        assert set(devices) == set("abc")
        seen.add(shape({k: (v[0], len(v)) for k, v in devices.items()}, 0, 4))
    assert seen == classes, "every class is placed, none twice"


def test_results_name_the_commit_they_were_measured_on(monkeypatch, tmp_path):
    common = _load(BENCHMARKS_DIR / "_common.py", monkeypatch)
    monkeypatch.setattr(common, "REPO", tmp_path)
    common.write_results("x", "# X\n", {"a": 1}, commit="abc1234")
    assert (tmp_path / "docs/benchmarks/x.md").read_text().endswith("Measured on commit abc1234.\n")
    assert json.loads((tmp_path / "docs/benchmarks/x.json").read_text()) == {
        "a": 1, "commit": "abc1234"
    }  # fmt: skip
    common.write_results("y", "commit abc1234, 3 s\n", [1], commit="abc1234")
    assert (tmp_path / "docs/benchmarks/y.md").read_text() == "commit abc1234, 3 s\n"


def test_async_rl_counts_samples_until_the_trailing_reward_reaches_the_target(monkeypatch):
    bench = _load(BENCHMARKS_DIR / "async_rl.py", monkeypatch)
    window = bench.WINDOW
    rewards = [0.0] * window + [1.0] * window
    case = {"trailing_reward": bench.trailing(rewards), "samples_per_step": 8}
    assert case["trailing_reward"][window - 1] == 0.0 and case["trailing_reward"][-1] == 1.0
    # the mean of the last `window` steps first reaches 0.5 once half of them score 1
    assert bench.samples_to(0.5, case) == (window + window // 2) * 8
    assert bench.samples_to(1.01, case) is None
    early = {"trailing_reward": bench.trailing([1.0] * (2 * window)), "samples_per_step": 8}
    assert bench.samples_to(1.0, early) == window * 8, "not before a whole window was seen"


def test_async_rl_compares_the_samples_to_each_share_of_k0_s_rise(monkeypatch):
    bench = _load(BENCHMARKS_DIR / "async_rl.py", monkeypatch)
    window = bench.WINDOW
    ramp = [i / (4 * window) for i in range(4 * window)]  # k=0 rises steadily from 0
    slow = [r / 2 for r in ramp] + [0.5] * (4 * window)  # half as fast, then flat at half
    base = {"trailing_reward": bench.trailing(ramp), "samples_per_step": 8}
    case = {"trailing_reward": bench.trailing(slow), "samples_per_step": 8}
    ratios = bench.samples_ratios(case, base)
    assert len(ratios) == len(bench.RISE) and ratios[-1] is None, "never 75% of the way"
    assert ratios[0] is not None and 1.5 < ratios[0] < 2.5, ratios  # about twice the samples
    assert bench.samples_ratios(base, base) == [1.0] * len(bench.RISE)
    one = {"seed_rewards": [ramp]}
    two = {"seed_rewards": [ramp, [r + 0.2 for r in ramp]]}
    assert bench.final_error(one) == 0.0
    assert abs(bench.final_error(two) - 0.1) < 1e-9  # 0.2 apart: stdev 0.2/sqrt2, over sqrt2


def test_partial_rollouts_measures_generation_after_a_newer_version(monkeypatch):
    bench = _load(BENCHMARKS_DIR / "partial_rollouts.py", monkeypatch)

    def span(name: str, step: int, start_ms: float, end_ms: float, phase: str = "train"):
        return {"cat": "call", "name": name, "ts": start_ms * 1e3, "dur": (end_ms - start_ms) * 1e3,
                "args": {"step": step, "phase": phase}}  # fmt: skip

    # the generate call of step i+1 runs for 100 ms from 100*i; the train call of step i ends
    # 40 ms into it from step 2 on, and after it at step 1
    events = [span("actor_gen", i + 1, 100 * i, 100 * i + 100) for i in range(6)]
    events += [span("actor_train", i, 0, 100 * i + (40 if i >= 2 else 150)) for i in range(6)]
    events.append(span("actor_gen", 3, 0, 10_000, phase="eval"))  # not a train-phase call
    got = bench.in_flight(events, k=1, warmup=0)
    # steps 1-5 (step 0 is warm-up): none in flight at step 1, 60% of the generation after
    assert got["periods"] == 5 and got["periods_with_any"] == 4
    assert abs(got["share"] - 4 * 0.6 / 5) < 1e-9
    assert got["generate_ms"] == 100 and got["generator_idle_ms"] == 0
    assert bench.in_flight(events, k=1, warmup=1)["periods"] == 4


def test_lora_demo_reports_each_way_at_its_best_mean_over_the_seeds(monkeypatch):
    bench = _load(BENCHMARKS_DIR / "lora_demo.py", monkeypatch)
    # 0.001 has the best single run, 0.002 the best mean: the mean decides
    grid = {0.001: [0.9, 0.1, 0.2], 0.002: [0.6, 0.6, 0.5], 0.005: [0.4, 0.4, 0.4]}
    assert bench.chosen_rate(grid) == 0.002
    rows = [{"task_reward": r, "step": i + 1} for i, r in enumerate([0.0] * 5 + [1.0] * 5)]
    assert bench.final(rows, 5) == 1.0 and bench.final(rows, 10) == 0.5


def test_lora_demo_grows_a_grid_past_the_edge_its_best_rate_is_at(monkeypatch):
    bench = _load(BENCHMARKS_DIR / "lora_demo.py", monkeypatch)
    start = (1e-3, 2e-3, 5e-3)
    assert bench.beyond_edge({1e-3: [0.7], 2e-3: [0.6], 5e-3: [0.5]}, start) == [5e-4]
    assert bench.beyond_edge({1e-3: [0.5], 2e-3: [0.6], 5e-3: [0.7]}, start) == [1e-2]
    assert bench.beyond_edge({5e-4: [0.7], 1e-3: [0.8], 2e-3: [0.6], 5e-3: [0.5]}, start) == []
    grown = {2e-4: [0.9], 5e-4: [0.8], 1e-3: [0.7], 2e-3: [0.6], 5e-3: [0.5], 1e-4: [0.95]}
    assert bench.beyond_edge(grown, start) == []  # three steps past it: no further


def _linked(page: Path) -> set[Path]:
    """The files a Markdown page links to, resolved (outside links and anchors dropped)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return {
        (page.parent / t.split("#")[0]).resolve()
        for t in targets
        if "://" not in t and not t.startswith("#")
    }


def test_the_index_names_every_script_and_its_links_resolve():
    index = BENCHMARKS_DIR / "README.md"
    linked = _linked(index)
    assert len(BENCHMARKS) >= 20
    missing = [p.name for p in BENCHMARKS if p.resolve() not in linked]
    assert missing == [], f"add these to benchmarks/README.md: {missing}"
    assert [p for p in linked if not p.exists()] == []


def test_every_record_is_linked_from_some_page():
    repo = BENCHMARKS_DIR.parent
    records = sorted((repo / "docs" / "benchmarks").glob("*.md"))
    pages = [repo / "README.md", BENCHMARKS_DIR / "README.md", *(repo / "docs").rglob("*.md")]
    linked = {t for page in pages for t in _linked(page) - {page.resolve()}}
    assert len(records) >= 20
    orphans = [p.name for p in records if p.resolve() not in linked]
    assert orphans == [], f"link these from benchmarks/README.md or a doc: {orphans}"


def test_suite_time_sums_each_test_s_phases_and_reads_pytest_s_total(monkeypatch):
    """suite_time reads pytest's ``--durations=0`` lines: a test's set-up, call and tear-down
    add up, files sum their tests, and each summary line gives a pytest's outcome and total
    (scripts/test.sh runs three: the quick tests, the slow ones, the slow ones run alone; a
    log of an older scripts/test.sh two)."""
    suite = _load(BENCHMARKS_DIR / "suite_time.py", monkeypatch)
    log = "\n".join([
        "12.50s call     tests/integration/test_a.py::test_one[x]",
        "2.00s setup    tests/integration/test_a.py::test_one[x]",
        "0.50s teardown tests/integration/test_a.py::test_one[x]",
        "3.00s call     tests/integration/test_a.py::test_two",
        "4.00s call     tests/unit/test_b.py::test_three",
        "(36 durations < 0.005s hidden.  Use -vv to show these durations.)",
        "====== 3 passed, 1 skipped in 1234.56s (0:20:34) ======",
    ])  # fmt: skip
    per_test, runs = suite.parse(log)
    assert per_test == {
        "tests/integration/test_a.py::test_one[x]": 15.0,
        "tests/integration/test_a.py::test_two": 3.0,
        "tests/unit/test_b.py::test_three": 4.0,
    }
    assert runs == [("3 passed, 1 skipped", 1234.56)]
    assert suite.per_file(per_test) == {
        "tests/integration/test_a.py": 18.0, "tests/unit/test_b.py": 4.0,
    }  # fmt: skip
    text, data = suite.report(log, 1500.0, "abc1234")
    assert "| pytest: 3 passed, 1 skipped | 1235 | 20.6 |" in text and "abc1234" in text
    assert data["wall_s"] == 1500.0 and data["pytest_s"] == 1234.56
    quick = "1507 passed, 19 warnings in 288.12s (0:04:48)"  # pytest -q prints no rule
    two = f"{quick}\n200 passed, 20 skipped in 211.88s"
    assert suite.parse(two)[1] == [
        ("1507 passed, 19 warnings", 288.12),
        ("200 passed, 20 skipped", 211.88),
    ]
    text, data = suite.report(two, None, "abc1234")
    assert "| pytest, the quick tests, both cores: 1507 passed, 19 warnings | 288 | 4.8 |" in text
    assert "| pytest, the slow tests, one at a time: 200 passed, 20 skipped | 212 | 3.5 |" in text
    assert "| 500 | 8.3 |" in text and data["pytest_s"] == 500.0
    three = f"{two}\n2 passed in 60.00s"
    text, data = suite.report(three, None, "abc1234")
    assert "| pytest, the slow tests, both cores, a file to a worker: 200 passed" in text
    assert "| pytest, the `alone` ones, one at a time: 2 passed | 60 | 1.0 |" in text
    assert data["pytest_s"] == 560.0
