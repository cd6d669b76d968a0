"""Rendering KubeRay manifests for a run (``rayhf.k8s.render``): what the RayJob, RayCluster and
RayService say, and that the written files validate."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from k8s_support import CHECKPOINT, EXAMPLE, K8S_MARKS
from k8s_support import crds as crds
from k8s_support import rendered as rendered

from rayhf.errors import RayhfError
from rayhf.k8s import check_paths, validate_paths
from rayhf.k8s.render import (
    SERVE_IMPORT_PATH,
    dns_name,
    parse_cluster,
    render,
    write_manifests,
)

pytestmark = K8S_MARKS


def test_rendered_manifests_are_valid(rendered: list[dict], tmp_path: Path, crds) -> None:
    paths = write_manifests(rendered, tmp_path)
    assert sorted(p.name for p in paths) == [
        "configmap-ppo-tiny-config.yaml",
        "raycluster-ppo-tiny-dev.yaml",
        "rayjob-ppo-tiny.yaml",
        "rayservice-ppo-tiny-serve.yaml",
    ]
    assert not list(tmp_path.glob(".*.tmp"))
    result = validate_paths([str(tmp_path)], crds)
    assert all(errors == [] for errors in result.values()) and len(result) == 4
    reports = check_paths([str(tmp_path)], crds)
    assert sorted(r.kind for r in reports if r.skipped is None) == [
        "RayCluster",
        "RayJob",
        "RayService",
    ]
    assert [yaml.safe_load(p.read_text()) for p in paths] == rendered  # round trip


def test_rayjob_runs_rayhf_on_every_gpu(rendered: list[dict]) -> None:
    job = next(d for d in rendered if d["kind"] == "RayJob")
    assert shlex.split(job["spec"]["entrypoint"]) == [
        "rayhf",
        "run",
        "/etc/rayhf/ppo_tiny.yaml",
        "cluster.address=auto",
        "cluster.device=cuda",
        "cluster.n_devices=16",
        "run_dir=/mnt/rayhf/runs/ppo-tiny",
        "resume=auto",  # a retry (backoffLimit) continues from the run's last checkpoint
    ]
    assert job["spec"]["backoffLimit"] == 2
    config = next(d for d in rendered if d["kind"] == "ConfigMap")
    assert config["data"]["ppo_tiny.yaml"] == EXAMPLE.read_text()
    cluster = job["spec"]["rayClusterSpec"]
    head, (worker,) = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_resources = head["template"]["spec"]["containers"][0]["resources"]
    assert not any("gpu" in k for part in head_resources.values() for k in part)
    assert worker["replicas"] == worker["minReplicas"] == worker["maxReplicas"] == 2
    assert (
        worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "8"
    )


def test_every_ray_pod_has_shm_and_the_same_image(rendered: list[dict]) -> None:
    for doc in rendered:
        if doc["kind"] == "ConfigMap":
            continue
        spec = doc["spec"]
        cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
        assert cluster["rayVersion"] == "2.60.0"
        for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
            pod = group["template"]["spec"]
            shm = [v for v in pod["volumes"] if v.get("emptyDir") == {"medium": "Memory"}]
            assert len(shm) == 1
            for container in pod["containers"]:
                assert container["image"] == "me/rayhf:1"
                mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
                assert mounts[shm[0]["name"]] == "/dev/shm"


def test_rayservice_serves_the_checkpoint(rendered: list[dict]) -> None:
    service = next(d for d in rendered if d["kind"] == "RayService")
    (application,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert application["import_path"] == SERVE_IMPORT_PATH == "rayhf.serve.app:build_app"
    assert application["args"] == {"checkpoint": CHECKPOINT}


def test_render_without_checkpoint_has_no_rayservice() -> None:
    kinds = [d["kind"] for d in render(EXAMPLE, "1x2")]
    assert kinds == ["ConfigMap", "RayJob", "RayCluster"]


def test_parse_cluster() -> None:
    shape = parse_cluster("2x8xH100")
    assert (shape.n_nodes, shape.gpus_per_node, shape.gpu_type, shape.n_devices) == (
        2,
        8,
        "H100",
        16,
    )
    assert parse_cluster("4 x 2").n_devices == 8 and parse_cluster("4x2").gpu_type is None
    for bad in ("2x0", "0x8", "8", "2x8x", "twoxeight"):
        with pytest.raises(RayhfError, match="--cluster"):
            parse_cluster(bad)


def test_render_rejects_a_bad_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("steps: 200", "stepz: 200"))
    with pytest.raises(RayhfError, match="stepz"):
        render(bad, "1x8")


@pytest.mark.parametrize(
    "raw,name",
    [
        ("ppo_tiny", "ppo-tiny"),
        ("PPO Tiny!", "ppo-tiny"),
        ("7b-run", "rayhf-7b-run"),
        ("__", "rayhf"),
    ],
)
def test_object_names_are_dns_labels(raw: str, name: str) -> None:
    assert dns_name(raw) == name
    assert dns_name("a" * 39 + "-b") == "a" * 39  # cut to 40, never ending in '-'


def test_render_options_name_the_objects_and_bad_ones_are_refused(tmp_path: Path) -> None:
    docs = render(EXAMPLE, "1x2", name="My Run", namespace="team-a")
    assert [d["metadata"]["name"] for d in docs] == ["my-run-config", "my-run", "my-run-dev"]
    assert {d["metadata"]["namespace"] for d in docs} == {"team-a"}
    with pytest.raises(RayhfError, match="render option cpus_per_gpu"):
        render(EXAMPLE, "1x2", cpus_per_gpu=0)
    with pytest.raises(RayhfError, match="two manifests would share a file name"):
        write_manifests([docs[1], docs[1]], tmp_path)
