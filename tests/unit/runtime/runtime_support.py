"""What the step-schedule and driver tests share: the PPO graph and each role's home layout."""

from __future__ import annotations

from pathlib import Path

from rayhf.graph import load_graph
from rayhf.parallel.layout import Layout

PPO = load_graph(Path(__file__).parents[3] / "graphs" / "ppo.yaml")


def _homes(layouts: dict[str, Layout]) -> dict[str, Layout]:
    """Each role's home: the layout of its train call, else of its first call."""
    homes: dict[str, Layout] = {}
    for name in PPO.order:
        call = PPO.by_name[name]
        if call.kind == "train" or call.role not in homes:
            homes[call.role] = layouts[name]
    return homes
