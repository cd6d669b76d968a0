"""What the planner tests share: the PPO graph, a 7B model per role and a workload per call."""

from __future__ import annotations

from pathlib import Path

from rayhf.graph import load_graph
from rayhf.models.shapes import public_shape
from rayhf.planner.cost import Workload

REPO = Path(__file__).resolve().parents[3]
GRAPH = load_graph(REPO / "graphs" / "ppo.yaml")
SPECS = {
    "actor": public_shape("llama2-7b"),
    "ref": public_shape("llama2-7b"),
    "critic": public_shape("llama2-7b", value_head=True),
    "reward": public_shape("llama2-7b", value_head=True),
}
WORKS = {
    c.name: Workload(c.kind, 512, 128, 128, 4 if c.kind == "train" else 1) for c in GRAPH.calls
}
