"""What the run tests share: a run's trace by step, and the units the planner prices for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayhf.config import ExperimentConfig
from rayhf.metrics.trace import TRACE_FILE, read_trace
from rayhf.planner.cost import AnalyticCost
from rayhf.planner.hardware import cpu_cluster
from rayhf.planner.problem import Problem
from rayhf.planner.simulate import simulate
from rayhf.runtime.assets import RunAssets
from rayhf.runtime.planning import planner_workloads, step_options


def spans_by_step(run_dir: Path, phase: str = "train") -> dict[int, list[dict[str, Any]]]:
    """The run's own spans (calls, moves, blends) of each step, in the order the driver
    reported them."""
    out: dict[int, list[dict[str, Any]]] = {}
    for e in read_trace(run_dir / TRACE_FILE):
        if e["pid"] == 0 and e["ph"] == "X" and e["args"]["phase"] == phase:
            out.setdefault(e["args"]["step"], []).append(e)
    return out


def priced_units(cfg: ExperimentConfig, assets: RunAssets) -> list[str]:
    """The units the simulator prices for one step of this run's plan."""
    works = planner_workloads(cfg, assets.graph, assets.dataset)
    cost = AnalyticCost(cpu_cluster(cfg.cluster.n_devices, cfg.cluster.device_memory_gb))
    problem = Problem(assets.graph, assets.specs, works, cost, step_options(cfg))
    sim = simulate(problem, assets.plan, n_iterations=1)
    return [s.name for s in sim.spans if s.iteration == 0]


def assert_trace_is_priced(cfg: ExperimentConfig, assets: RunAssets) -> None:
    """Every step of the run's trace has exactly the units the simulator prices, in order."""
    steps = spans_by_step(Path(cfg.resolved_run_dir()))
    priced = priced_units(cfg, assets)
    assert steps and all([e["name"] for e in spans] == priced for spans in steps.values())
