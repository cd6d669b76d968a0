"""Cluster spec, layouts and plans (pure Python, no Ray)."""

from rayhf.planner.cluster import ClusterConfig
from rayhf.planner.layout import Layout, LayoutSpec
from rayhf.planner.plan import Plan, PlanConfig, format_plan, make_plan

__all__ = [
    "ClusterConfig",
    "Layout",
    "LayoutSpec",
    "Plan",
    "PlanConfig",
    "format_plan",
    "make_plan",
]
