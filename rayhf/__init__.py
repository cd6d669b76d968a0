"""rayhf: RLHF on Ray, each model call in its own layout (the ReaLHF idea).

The public API for driver scripts (``ray job submit -- python my_driver.py``)::

    import rayhf
    cfg = rayhf.load_config("examples/ppo_tiny.yaml", ["steps=10"])
    cfg = cfg.with_overrides({"algorithm.kl_coef": 0.02})
    print(rayhf.format_plan(rayhf.make_plan(cfg), rayhf.load_graph(cfg.graph_path())))
    result = rayhf.run(cfg)
    result.metrics, result.policy_checkpoint
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rayhf import startup  # first: the collector paused while the imports below load
from rayhf.config import ExperimentConfig, load_config
from rayhf.errors import RayhfError
from rayhf.graph import load_graph
from rayhf.planner import Plan, format_plan

startup.imported()

if TYPE_CHECKING:
    from rayhf.runtime.trainer import RunResult

__version__ = "0.1.0"


def make_plan(cfg: ExperimentConfig) -> Plan:
    """The plan ``rayhf run`` would use for ``cfg`` (no Ray started). For ``plan: auto`` on
    emulated devices that is the run's own search: the roles' models are made in a temporary
    directory and timed on this machine (cached; the first time takes seconds per shape)."""
    from rayhf.planner import make_plan as _make_plan
    from rayhf.planner.auto import searches
    from rayhf.runtime.assets import run_graph

    graph, _ = run_graph(cfg)
    if cfg.plan == "auto" and searches(cfg.cluster):
        import tempfile
        from pathlib import Path

        from rayhf.models.files import quiet_transformers
        from rayhf.runtime.assets import prepare_run

        quiet_transformers()
        with tempfile.TemporaryDirectory() as tmp:
            return prepare_run(cfg, Path(tmp)).plan
    return _make_plan(graph, cfg.plan, cfg.cluster)


def run(
    cfg: ExperimentConfig | None = None,
    resume: str | None = None,
    overrides: list[str] | None = None,
) -> RunResult:
    """Run ``cfg`` to the end (or continue the run in directory ``resume``, with ``overrides``
    of its saved config that are safe to change: steps, cadences, logging)."""
    from rayhf.runtime.trainer import run as _run

    return _run(cfg, resume, overrides)


__all__ = [
    "ExperimentConfig",
    "RayhfError",
    "format_plan",
    "load_config",
    "load_graph",
    "make_plan",
    "run",
]
