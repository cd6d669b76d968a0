"""KubeRay's own rules, checked once the CRD schema passed (the operator sees no other objects).

The rules are those the KubeRay operator enforces (``ray-operator/controllers/ray/utils/
validation.go`` and its admission webhooks), those that decide whether the Pods it creates
would be accepted (container names, requests <= limits, whole GPU counts), and one it does not
reject but silently "fixes": a worker group's ``replicas`` outside ``[minReplicas,
maxReplicas]`` is clamped, and a manifest that says one size and runs another is a mistake worth
naming. Every function takes the *normalized* document (CRD defaults filled in) and returns
errors prefixed with their field path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml

from rayhf.k8s.grammar import (
    QUANTITY_HINT,
    dns1035_label_error,
    dns1123_label_error,
    label_value_error,
    parse_quantity,
    qualified_name_error,
)

# KubeRay's MaxRayClusterNameLength (63 - len("-serve-svc")); RayJob and RayService names get a
# 6-character suffix for their RayCluster.
NAME_LIMITS = {"RayCluster": 53, "RayJob": 47, "RayService": 47}
RAY_START_RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")
FT_ANNOTATION = "ray.io/ft-enabled"
SUBMISSION_MODES = ("K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode")


def kuberay_errors(doc: dict[str, Any]) -> list[str]:
    """KubeRay's rules for one RayCluster / RayJob / RayService / RayCronJob document."""
    kind, spec = doc.get("kind"), doc.get("spec") or {}
    annotations = doc.get("metadata", {}).get("annotations", {})
    errors = name_errors(kind, doc.get("metadata", {}).get("name"))
    for path, cluster in cluster_specs(kind, spec):
        errors += cluster_spec_errors(cluster, path, annotations)
    if kind == "RayJob":
        errors += rayjob_errors(spec, "spec")
    elif kind == "RayCronJob":
        errors += rayjob_errors(spec.get("jobTemplate") or {}, "spec.jobTemplate")
        errors += cron_schedule_errors(spec.get("schedule", ""), "spec.schedule")
    elif kind == "RayService":
        errors += rayservice_errors(spec, "spec")
    return errors


def name_errors(kind: Any, name: Any) -> list[str]:
    """KubeRay names Services after the object: a DNS-1035 label short enough for the suffixes."""
    if kind not in NAME_LIMITS or not isinstance(name, str):
        return []
    why = dns1035_label_error(name, NAME_LIMITS[kind])
    return [f"metadata.name: {name!r} {why} (KubeRay names Services after it)"] if why else []


def cluster_specs(kind: Any, spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, RayClusterSpec) pairs embedded in a document of ``kind``."""
    nested = {
        "RayCluster": ("spec", spec),
        "RayJob": ("spec.rayClusterSpec", spec.get("rayClusterSpec")),
        "RayService": ("spec.rayClusterConfig", spec.get("rayClusterConfig")),
        "RayCronJob": (
            "spec.jobTemplate.rayClusterSpec",
            (spec.get("jobTemplate") or {}).get("rayClusterSpec"),
        ),
    }
    path, cluster = nested.get(kind, ("", None))
    if isinstance(cluster, dict):
        yield path, cluster


def cluster_spec_errors(cluster: dict[str, Any], path: str, annotations: dict) -> list[str]:
    """Head and worker groups: containers present, unique names, replicas, params, pods."""
    head = cluster.get("headGroupSpec") or {}
    errors = group_errors(head, f"{path}.headGroupSpec", "head")
    names: set[str] = set()
    for i, group in enumerate(cluster.get("workerGroupSpecs") or []):
        group_path = f"{path}.workerGroupSpecs[{i}]"
        name = group.get("groupName", "")
        if name in names:
            errors.append(f"{group_path}.groupName: duplicate worker group name {name!r}")
        names.add(name)
        errors += group_errors(group, group_path, "worker")
        errors += replica_errors(group, group_path)
    if annotations.get(FT_ANNOTATION) and cluster.get("gcsFaultToleranceOptions"):
        errors.append(
            f"{path}.gcsFaultToleranceOptions: set either it or the {FT_ANNOTATION} "
            "annotation, not both"
        )
    if (head.get("rayStartParams") or {}).get("redis-username"):
        errors.append(
            f"{path}.headGroupSpec.rayStartParams[redis-username]: use "
            "gcsFaultToleranceOptions.redisUsername instead"
        )
    errors += auth_errors(cluster, path)
    return errors


def group_errors(group: dict[str, Any], path: str, role: str) -> list[str]:
    """One head or worker group: a container, consistent rayStartParams, valid pod fields."""
    pod = (group.get("template") or {}).get("spec") or {}
    errors = []
    if not pod.get("containers"):
        errors.append(
            f"{path}.template.spec.containers: the {role} group needs at least one container "
            "(the first one runs Ray)"
        )
    params = group.get("rayStartParams") or {}
    if "labels" in params:
        errors.append(f"{path}.rayStartParams[labels]: not supported; use {path}.labels instead")
    if group.get("resources") and any(params.get(k) for k in RAY_START_RESOURCE_PARAMS):
        errors.append(
            f"{path}.resources: set Ray resources either here or in rayStartParams "
            f"({', '.join(RAY_START_RESOURCE_PARAMS)}), not both"
        )
    errors += label_errors(group.get("labels") or {}, f"{path}.labels")
    template_labels = ((group.get("template") or {}).get("metadata") or {}).get("labels") or {}
    errors += label_errors(template_labels, f"{path}.template.metadata.labels")
    return errors + pod_errors(pod, f"{path}.template.spec")


def replica_errors(group: dict[str, Any], path: str) -> list[str]:
    """``replicas`` must lie in ``[minReplicas, maxReplicas]`` (KubeRay would clamp it)."""
    if group.get("suspend"):
        return []
    low, high = group.get("minReplicas", 0), group.get("maxReplicas", 2**31 - 1)
    replicas = group.get("replicas", 0)
    if low > high:
        return [f"{path}.minReplicas: {low} is greater than maxReplicas {high}"]
    if not low <= replicas <= high:
        clamped = min(max(replicas, low), high)
        return [
            f"{path}.replicas: {replicas} is outside [minReplicas, maxReplicas] = [{low}, {high}]"
            f"; KubeRay would run {clamped}"
        ]
    return []


def label_errors(labels: dict[str, Any], path: str) -> list[str]:
    """Label keys and values that the API server would refuse on the objects KubeRay creates."""
    errors = []
    for key, value in labels.items():
        why_key = qualified_name_error(str(key))
        if why_key:
            errors.append(f"{path}[{key}]: invalid label key: {why_key}")
        why_value = label_value_error(value) if isinstance(value, str) else None
        if why_value:
            errors.append(f"{path}[{key}]: invalid label value {value!r}: {why_value}")
    return errors


def auth_errors(cluster: dict[str, Any], path: str) -> list[str]:
    """Token authentication needs Ray 2.52 or later, so a stated rayVersion."""
    if (cluster.get("authOptions") or {}).get("mode") != "token":
        return []
    version = str(cluster.get("rayVersion") or "")
    parts = [int(p) for p in version.split(".")[:3] if p.isdigit()]
    if len(parts) < 2 or parts < [2, 52]:
        return [f"{path}.rayVersion: authOptions.mode token needs rayVersion 2.52.0 or later"]
    return []


def pod_errors(pod: dict[str, Any], path: str) -> list[str]:
    """What the API server would refuse when KubeRay creates the Pods from this template."""
    errors = []
    for field in ("initContainers", "containers"):
        for i, container in enumerate(pod.get(field) or []):
            container_path = f"{path}.{field}[{i}]"
            why = dns1123_label_error(str(container.get("name", "")))
            if why:
                errors.append(f"{container_path}.name: {container.get('name')!r} {why}")
            errors += resource_errors(container.get("resources") or {}, container_path)
    return errors


def _is_extended(resource: str) -> bool:
    """GPUs and other device-plugin resources: whole numbers, not overcommitted."""
    return "/" in resource and not resource.startswith(("kubernetes.io/", "requests."))


def resource_errors(resources: dict[str, Any], path: str) -> list[str]:
    """Container requests and limits: non-negative, request <= limit, whole device counts."""
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    errors = []
    for kind, values in (("limits", limits), ("requests", requests)):
        for name, raw in values.items():
            amount = parse_quantity(raw)
            where = f"{path}.resources.{kind}[{name}]"
            if amount is None:
                errors.append(f"{where}: {raw!r} is not a valid quantity; use {QUANTITY_HINT}")
            elif amount < 0:
                errors.append(f"{where}: must not be negative, got {raw!r}")
            elif _is_extended(name) and amount != amount.to_integral_value():
                errors.append(f"{where}: {name} must be a whole number, got {raw!r}")
    for name, raw in requests.items():
        errors += _request_vs_limit(name, raw, limits.get(name), f"{path}.resources.requests")
    return errors


def _request_vs_limit(name: str, request: Any, limit: Any, path: str) -> list[str]:
    wanted, cap = parse_quantity(request), parse_quantity(limit) if limit is not None else None
    if wanted is None:
        return []
    if _is_extended(name) and (cap is None or cap != wanted):
        return [f"{path}[{name}]: {name} must be set in limits, to the same value as requests"]
    if cap is not None and wanted > cap:
        return [f"{path}[{name}]: {request!r} is more than the limit {limit!r}"]
    return []


def rayjob_errors(spec: dict[str, Any], path: str) -> list[str]:
    """RayJob rules of ValidateRayJobSpec (the deletion-strategy rules are CRD CEL rules)."""
    errors = []
    shutdown = spec.get("shutdownAfterJobFinishes", False)
    if spec.get("suspend") and not shutdown:
        errors.append(
            f"{path}.suspend: a RayJob can be suspended only with shutdownAfterJobFinishes"
        )
    if not shutdown and spec.get("ttlSecondsAfterFinished", 0) > 0:
        errors.append(
            f"{path}.ttlSecondsAfterFinished: needs shutdownAfterJobFinishes: true to take effect"
        )
    selector = spec.get("clusterSelector") or {}
    if not spec.get("rayClusterSpec") and not selector:
        errors.append(f"{path}.rayClusterSpec: set rayClusterSpec or clusterSelector")
    if selector and not selector.get("ray.io/cluster"):
        errors.append(f"{path}.clusterSelector[ray.io/cluster]: name the RayCluster to run on")
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode not in SUBMISSION_MODES:
        errors.append(
            f"{path}.submissionMode: {mode!r} is not one of {', '.join(SUBMISSION_MODES)}"
        )
    if mode == "InteractiveMode" and spec.get("backoffLimit", 0) > 0:
        errors.append(f"{path}.backoffLimit: InteractiveMode does not support retries; use 0")
    if mode == "SidecarMode":
        errors += [
            f"{path}.{field}: not supported with submissionMode SidecarMode"
            for field in ("submitterPodTemplate", "submitterConfig", "clusterSelector")
            if spec.get(field)
        ]
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        errors.append(f"{path}.activeDeadlineSeconds: must be a positive number of seconds")
    return errors + runtime_env_errors(spec.get("runtimeEnvYAML"), f"{path}.runtimeEnvYAML")


def runtime_env_errors(text: Any, path: str) -> list[str]:
    """``runtimeEnvYAML`` must be a YAML mapping (KubeRay parses it before submitting)."""
    if not text:
        return []
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"{path}: not valid YAML: {str(e).splitlines()[0]}"]
    return [] if isinstance(parsed, dict) else [f"{path}: must be a YAML mapping"]


def cron_schedule_errors(schedule: str, path: str) -> list[str]:
    """A standard 5-field cron schedule (optionally ``TZ=...``) or a ``@`` descriptor."""
    fields = schedule.split()
    if fields and fields[0].startswith(("TZ=", "CRON_TZ=")):
        fields = fields[1:]
    if (len(fields) == 1 and fields[0].startswith("@")) or len(fields) == 5:
        return []
    return [f"{path}: {schedule!r} is not a 5-field cron schedule (minute hour day month weekday)"]


def rayservice_errors(spec: dict[str, Any], path: str) -> list[str]:
    """RayService rules of ValidateRayServiceSpec."""
    cluster = spec.get("rayClusterConfig") or {}
    head_service = (cluster.get("headGroupSpec") or {}).get("headService") or {}
    errors = []
    if (head_service.get("metadata") or {}).get("name"):
        errors.append(
            f"{path}.rayClusterConfig.headGroupSpec.headService.metadata.name: must not be set "
            "for a RayService (KubeRay names it)"
        )
    strategy = (spec.get("upgradeStrategy") or {}).get("type")
    allowed = ("NewClusterWithIncrementalUpgrade", "NewCluster", "None")
    if strategy is not None and strategy not in allowed:
        errors.append(f"{path}.upgradeStrategy.type: {strategy!r} is not one of {allowed}")
    return errors
