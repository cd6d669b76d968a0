"""KubeRay's own rules on a schema-valid object (``rayhf.k8s.kuberay``), checked one by one on
hand-written documents (no CRDs needed)."""

from __future__ import annotations

import pytest

from rayhf.k8s.kuberay import (
    auth_errors,
    cron_schedule_errors,
    kuberay_errors,
    label_errors,
    name_errors,
    rayjob_errors,
    rayservice_errors,
    replica_errors,
    resource_errors,
)


def test_replicas_outside_their_bounds_name_what_kuberay_would_run() -> None:
    assert replica_errors({"replicas": 3, "minReplicas": 1, "maxReplicas": 4}, "g") == []
    assert replica_errors({"replicas": 0, "minReplicas": 1, "maxReplicas": 4}, "g") == [
        "g.replicas: 0 is outside [minReplicas, maxReplicas] = [1, 4]; KubeRay would run 1"
    ]
    assert replica_errors({"minReplicas": 5, "maxReplicas": 4}, "g") == [
        "g.minReplicas: 5 is greater than maxReplicas 4"
    ]
    assert replica_errors({"replicas": 9, "maxReplicas": 1, "suspend": True}, "g") == []


def test_container_requests_and_limits() -> None:
    ok = {
        "limits": {"cpu": "2", "nvidia.com/gpu": 1},
        "requests": {"cpu": "500m", "nvidia.com/gpu": "1"},
    }
    assert resource_errors(ok, "c") == []
    bad = {
        "limits": {"memory": "-1Gi", "nvidia.com/gpu": "0.5"},
        "requests": {"cpu": "3", "memory": "1Gi"},
    }
    assert resource_errors(bad, "c") == [
        "c.resources.limits[memory]: must not be negative, got '-1Gi'",
        "c.resources.limits[nvidia.com/gpu]: nvidia.com/gpu must be a whole number, got '0.5'",
        "c.resources.requests[memory]: '1Gi' is more than the limit '-1Gi'",
    ]


def test_rayjob_rules() -> None:
    assert rayjob_errors({"rayClusterSpec": {"headGroupSpec": {}}}, "spec") == []
    spec = {
        "suspend": True,
        "ttlSecondsAfterFinished": 60,
        "submissionMode": "InteractiveMode",
        "backoffLimit": 2,
        "activeDeadlineSeconds": 0,
        "runtimeEnvYAML": "- pip",
    }
    assert rayjob_errors(spec, "spec") == [
        "spec.suspend: a RayJob can be suspended only with shutdownAfterJobFinishes",
        "spec.ttlSecondsAfterFinished: needs shutdownAfterJobFinishes: true to take effect",
        "spec.rayClusterSpec: set rayClusterSpec or clusterSelector",
        "spec.backoffLimit: InteractiveMode does not support retries; use 0",
        "spec.activeDeadlineSeconds: must be a positive number of seconds",
        "spec.runtimeEnvYAML: must be a YAML mapping",
    ]
    sidecar = {"clusterSelector": {"app": "x"}, "submissionMode": "SidecarMode"}
    assert rayjob_errors(sidecar, "spec") == [
        "spec.clusterSelector[ray.io/cluster]: name the RayCluster to run on",
        "spec.clusterSelector: not supported with submissionMode SidecarMode",
    ]


@pytest.mark.parametrize(
    "schedule,ok",
    [("*/5 * * * *", True), ("TZ=UTC 0 1 * * *", True), ("@hourly", True), ("0 1 * *", False),
     ("", False)],
)  # fmt: skip
def test_cron_schedules(schedule: str, ok: bool) -> None:
    assert (cron_schedule_errors(schedule, "s") == []) is ok


def test_a_raycronjob_is_checked_through_its_job_template() -> None:
    doc = {
        "kind": "RayCronJob",
        "metadata": {"name": "nightly"},
        "spec": {"schedule": "nightly", "jobTemplate": {"submissionMode": "Batch"}},
    }
    assert kuberay_errors(doc) == [
        "spec.jobTemplate.rayClusterSpec: set rayClusterSpec or clusterSelector",
        "spec.jobTemplate.submissionMode: 'Batch' is not one of K8sJobMode, HTTPMode, "
        "InteractiveMode, SidecarMode",
        "spec.schedule: 'nightly' is not a 5-field cron schedule (minute hour day month weekday)",
    ]


def test_cluster_spec_rules() -> None:
    head = {
        "rayStartParams": {"redis-username": "u", "labels": "a=b"},
        "template": {"spec": {"containers": [{"name": "Ray_Head"}]}},
    }
    worker = {
        "groupName": "w",
        "replicas": 1,
        "minReplicas": 1,
        "maxReplicas": 1,
        "resources": {"CPU": "1"},
        "rayStartParams": {"num-cpus": "1"},
        "template": {"spec": {"containers": [{"name": "w"}]}},
    }
    cluster = {
        "headGroupSpec": head,
        "workerGroupSpecs": [worker],
        "gcsFaultToleranceOptions": {"redisAddress": "r:6379"},
    }
    meta = {"name": "c", "annotations": {"ray.io/ft-enabled": "true"}}
    assert kuberay_errors({"kind": "RayCluster", "metadata": meta, "spec": cluster}) == [
        "spec.headGroupSpec.rayStartParams[labels]: not supported; use spec.headGroupSpec.labels "
        "instead",
        "spec.headGroupSpec.template.spec.containers[0].name: 'Ray_Head' must consist of lower "
        "case alphanumeric characters or '-', and must start and end with an alphanumeric "
        "character",
        "spec.workerGroupSpecs[0].resources: set Ray resources either here or in rayStartParams "
        "(num-cpus, num-gpus, memory, resources), not both",
        "spec.gcsFaultToleranceOptions: set either it or the ray.io/ft-enabled annotation, not "
        "both",
        "spec.headGroupSpec.rayStartParams[redis-username]: use "
        "gcsFaultToleranceOptions.redisUsername instead",
    ]


def test_names_labels_auth_and_rayservice_rules() -> None:
    assert name_errors("RayJob", "x" * 47) == [] and name_errors("ConfigMap", "x" * 99) == []
    (error,) = name_errors("RayJob", "x" * 48)
    assert "must be no more than 47 characters (KubeRay names Services after it)" in error
    assert len(label_errors({"a b": "-x"}, "p")) == 2
    token = {"authOptions": {"mode": "token"}}
    assert auth_errors({**token, "rayVersion": "2.52.0"}, "spec") == []
    for version in ("2.51.1", None):
        assert auth_errors({**token, "rayVersion": version}, "spec") == [
            "spec.rayVersion: authOptions.mode token needs rayVersion 2.52.0 or later"
        ]
    service = {
        "rayClusterConfig": {"headGroupSpec": {"headService": {"metadata": {"name": "svc"}}}},
        "upgradeStrategy": {"type": "Rolling"},
    }
    errors = rayservice_errors(service, "spec")
    assert [e.split(":")[0] for e in errors] == [
        "spec.rayClusterConfig.headGroupSpec.headService.metadata.name",
        "spec.upgradeStrategy.type",
    ]
