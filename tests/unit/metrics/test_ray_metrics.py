"""Ray metrics names and tags, and the Grafana dashboard that reads them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest

from rayhf.metrics.tracker import RayMetricsSink

REPO = Path(__file__).resolve().parents[3]
ROLES = {"actor_gen": "actor", "ref_inf": "ref", "actor_train": "actor"}
STEP = {  # what a PPO step with a reallocated generation and an EMA reference logs
    "task_reward": 0.4, "kl": 0.01, "step_seconds": 0.3, "tokens_per_s": 900.0,
    "seconds/actor_gen": 0.1, "seconds/ref_inf": 0.02, "seconds/actor_train": 0.05,
    "realloc_seconds/actor_gen": 0.01, "realloc_bytes/actor_gen": 7.7e5,
    "realloc_bytes/ref_ema": 7.7e5,
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
