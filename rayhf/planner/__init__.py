"""Cluster spec, plans and their search (pure Python, no Ray: it consumes profiles)."""

from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.layout import LayoutSpec
from rayhf.planner.plan import Plan, PlanConfig, format_plan, make_plan

__all__ = [
    "ClusterConfig",
    "LayoutSpec",
    "Plan",
    "PlanConfig",
    "format_plan",
    "make_plan",
]
