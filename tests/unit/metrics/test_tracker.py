"""Step metrics: the console line, the JSONL file cut back on resume, the sinks a config asks
for, and the Ray metrics names and tags with the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest

from rayhf.metrics.tracker import (
    METRICS_FILE,
    ConsoleSink,
    JsonlSink,
    MetricsConfig,
    ProgressSink,
    RayMetricsSink,
    Tracker,
    console_line,
    make_tracker,
    read_metrics,
)

REPO = Path(__file__).resolve().parents[3]
ROLES = {"actor_gen": "actor", "ref_inf": "ref", "actor_train": "actor"}
STEP = {  # what a PPO step with a reallocated generation and an EMA reference logs
    "task_reward": 0.4, "kl": 0.01, "step_seconds": 0.3, "tokens_per_s": 900.0,
    "seconds/actor_gen": 0.1, "seconds/ref_inf": 0.02, "seconds/actor_train": 0.05,
    "realloc_seconds/actor_gen": 0.01, "realloc_bytes/actor_gen": 7.7e5,
    "realloc_bytes/ref_ema": 7.7e5, "realloc_seconds": 0.01,
}  # fmt: skip


class FakeGauge:
    made: ClassVar[dict[str, FakeGauge]] = {}

    def __init__(self, name: str, description: str, tag_keys: tuple[str, ...]) -> None:
        self.tag_keys, self.points = tag_keys, []
        FakeGauge.made[name] = self

    def set(self, value: float, tags: dict[str, str]) -> None:
        assert set(tags) == set(self.tag_keys), "every tag key gets a value"
        self.points.append((value, tags))


@pytest.fixture
def gauges(monkeypatch) -> dict[str, FakeGauge]:
    FakeGauge.made = {}
    monkeypatch.setattr("ray.util.metrics.Gauge", FakeGauge)
    RayMetricsSink("ppo_tiny", ROLES).log(3, STEP)
    return FakeGauge.made


def test_per_call_metrics_are_one_metric_tagged_by_call_and_role(gauges):
    calls = {(t["call"], t["role"], v) for v, t in gauges["rayhf_call_seconds"].points}
    assert calls == {("actor_gen", "actor", 0.1), ("ref_inf", "ref", 0.02),
                     ("actor_train", "actor", 0.05)}  # fmt: skip
    moved = {(t["call"], t["role"]) for _, t in gauges["rayhf_realloc_bytes"].points}
    assert moved == {("actor_gen", "actor"), ("ref_ema", "ref")}
    assert gauges["rayhf_realloc_seconds"].points[0][1]["run"] == "ppo_tiny"
    assert gauges["rayhf_realloc_seconds_total"].points == [(0.01, {"run": "ppo_tiny"})]
    assert gauges["rayhf_task_reward"].points == [(0.4, {"run": "ppo_tiny"})]
    assert gauges["rayhf_step"].points == [(3.0, {"run": "ppo_tiny"})]
    assert not any("/" in name for name in gauges)


def test_the_grafana_dashboard_queries_only_metrics_rayhf_exports(gauges):
    dashboard = json.loads((REPO / "deployments" / "grafana" / "rayhf_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {m for e in exprs for m in re.findall(r"\bray_(rayhf_\w+)", e)}
    assert queried <= set(gauges), queried - set(gauges)  # Ray exports a Gauge as ray_<name>
    assert {"rayhf_call_seconds", "rayhf_realloc_seconds", "rayhf_realloc_bytes",
            "rayhf_task_reward", "rayhf_kl"} <= queried  # fmt: skip
    legends = {t["legendFormat"] for p in dashboard["panels"] for t in p["targets"]}
    assert "{{role}} / {{call}}" in legends


# ----- console, JSONL, sinks ----------------------------------------------------------------


def test_console_line_shows_known_metrics_evals_and_call_seconds():
    line = console_line(3, 10, {**STEP, "eval/nll": 1.23456, "unlisted": 5.0})
    assert line == (
        "step 3/10  reward 0.400  kl 0.0100  tok/s 900  s 0.30  eval/nll 1.235"
        "  | actor_gen 0.10s ref_inf 0.02s actor_train 0.05s"
    )
    assert console_line(1, 2, {}) == "step 1/2"


def test_jsonl_appends_a_row_per_step_and_reads_back(tmp_path):
    sink = JsonlSink(tmp_path / METRICS_FILE)
    sink.log(1, {"kl": 0.5})
    sink.log(2, {"kl": 0.25, "task_reward": 1.0})
    sink.close()
    assert read_metrics(tmp_path) == [
        {"step": 1, "kl": 0.5},
        {"step": 2, "kl": 0.25, "task_reward": 1.0},
    ]
    assert read_metrics(tmp_path / "nowhere") == []


def test_a_resumed_run_cuts_the_file_back_to_its_checkpoint(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(5)) + "\n")
    sink = JsonlSink(path, truncate_after=2)  # steps 3 and 4 are run again
    sink.log(3, {"x": 30})
    sink.close()
    assert [r["x"] for r in read_metrics(tmp_path)] == [0, 1, 2, 30]
    assert not path.with_suffix(".tmp").exists()


def test_tracker_fans_out_and_closes_every_sink():
    lines: list[str] = []
    logged = []

    class Recorder:
        def log(self, step, metrics):
            logged.append((step, metrics))

        def close(self):
            logged.append("closed")

    tracker = Tracker([ConsoleSink(5, write=lines.append), Recorder()])
    tracker.log(1, {"kl": 0.5})
    tracker.close()
    assert lines == ["step 1/5  kl 0.5000"]
    assert logged == [(1, {"kl": 0.5}), "closed"]


def test_make_tracker_builds_the_sinks_the_config_asks_for(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    kinds = lambda t: [type(s) for s in t.sinks]  # noqa: E731
    assert kinds(make_tracker(MetricsConfig(), tmp_path, "run", 10, 0)) == [
        ConsoleSink,
        JsonlSink,
        RayMetricsSink,
    ]  # no progress bar when stdout is not a terminal
    quiet = MetricsConfig(console=False, jsonl=False, ray_metrics=False, progress=True)
    tracker = make_tracker(quiet, tmp_path, "run", 10, 4)
    assert kinds(tracker) == [ProgressSink] and tracker.sinks[0].bar.n == 4
    tracker.log(0, {"task_reward": 1.0})  # the baseline evaluation is not a step
    tracker.log(5, {"task_reward": 1.0})
    assert tracker.sinks[0].bar.n == 5
    tracker.close()
    with pytest.raises(ValueError):
        MetricsConfig(plots=False)


def test_make_tracker_on_resume_truncates_metrics(tmp_path):
    (tmp_path / METRICS_FILE).write_text('{"step": 1}\n{"step": 2}\n')
    cfg = MetricsConfig(console=False, ray_metrics=False, progress=False)
    make_tracker(cfg, tmp_path, "run", 10, start=1).close()
    assert read_metrics(tmp_path) == [{"step": 1}]
    # a run starting over (a recovery before the first checkpoint) logs every step again
    make_tracker(cfg, tmp_path, "run", 10, start=0).close()
    assert read_metrics(tmp_path) == []
