"""The dataflow graph of one iteration, loaded from ``graphs/*.yaml``."""

from rayhf.graph.graph import Call, Graph, load_graph

__all__ = ["Call", "Graph", "load_graph"]
