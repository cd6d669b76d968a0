"""KubeRay manifests for rayhf: render them from a run config and validate them offline.

``render`` turns a rayhf config and a cluster shape into RayJob / RayCluster / RayService
documents; ``validate`` checks any KubeRay manifest the way the Kubernetes API server and the
KubeRay operator would (CRD schema, then KubeRay's own rules, then the embedded Serve config),
without a cluster. Nothing here imports Ray at module load.
"""

from __future__ import annotations

from rayhf.k8s.render import ClusterShape, RenderConfig, parse_cluster, render, write_manifests
from rayhf.k8s.schema import CRDSet
from rayhf.k8s.validate import DocumentReport, check_paths, validate_document, validate_paths

__all__ = [
    "CRDSet",
    "ClusterShape",
    "DocumentReport",
    "RenderConfig",
    "check_paths",
    "parse_cluster",
    "render",
    "validate_document",
    "validate_paths",
    "write_manifests",
]
