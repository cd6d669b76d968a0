"""Building kustomizations offline (``rayhf.k8s.kustomize``): the shipped overlays, strategic
merge and JSON 6902 patches, renames, and the fields it refuses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml
from k8s_support import K8S_MARKS, REPO
from k8s_support import crds as crds

from rayhf.config import load_config
from rayhf.k8s import validate_paths
from rayhf.k8s.kustomize import apply_json6902, build, strategic_merge
from rayhf.k8s.yamlio import ManifestError

pytestmark = K8S_MARKS


def _n_devices(entrypoint: str) -> int:
    return int(re.search(r"cluster\.n_devices=(\d+)", entrypoint)[1])  # type: ignore[index]


@pytest.mark.parametrize(
    "variant,workers,gpus", [("base", 1, 8), ("overlays/small", 1, 2), ("overlays/large", 16, 8)]
)
def test_overlays_resize_and_keep_n_devices_consistent(variant, workers, gpus) -> None:
    docs = {d["kind"]: d for d in build(REPO / "k8s" / variant)}
    job = docs["RayJob"]
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (workers,) * 3
    assert limits["nvidia.com/gpu"] == str(gpus)
    assert _n_devices(job["spec"]["entrypoint"]) == workers * gpus
    rayhf_, run, config, *overrides = shlex.split(job["spec"]["entrypoint"])
    assert (rayhf_, run) == ("rayhf", "run") and config.startswith("/app/")
    cfg = load_config(REPO / config.removeprefix("/app/"), overrides)  # the image's checkout
    assert cfg.cluster.n_devices == workers * gpus and cfg.cluster.device == "cuda"
    dev = docs["RayCluster"]["spec"]["workerGroupSpecs"][0]
    assert dev["maxReplicas"] == workers
    assert dev["template"]["spec"]["containers"][0]["resources"]["limits"] == limits


def test_strategic_merge_and_json6902() -> None:
    target = {
        "spec": {
            "containers": [{"name": "a", "image": "1"}, {"name": "b", "image": "2"}],
            "groups": [{"groupName": "x", "replicas": 1}, {"groupName": "y"}],
        }
    }
    patch = {
        "spec": {
            "containers": [{"name": "b", "image": "3"}],
            "groups": [{"groupName": "x", "replicas": 4}],
        }
    }
    merged = strategic_merge(target, patch)
    assert merged["spec"]["containers"] == [
        {"name": "a", "image": "1"},
        {"name": "b", "image": "3"},
    ]
    assert merged["spec"]["groups"] == [{"groupName": "x", "replicas": 4}]  # no key: replaced
    assert strategic_merge({"a": 1, "b": 2}, {"b": None}) == {"a": 1}
    doc = {"limits": {"nvidia.com/gpu": "8"}, "l": [1, 2]}
    ops = [
        {"op": "replace", "path": "/limits/nvidia.com~1gpu", "value": "2"},
        {"op": "add", "path": "/l/-", "value": 3},
        {"op": "remove", "path": "/l/0"},
    ]
    assert apply_json6902(doc, ops, "t") == {"limits": {"nvidia.com/gpu": "2"}, "l": [2, 3]}
    assert doc["l"] == [1, 2]  # the input is left alone


def test_kustomization_with_an_unsupported_field_is_an_error(tmp_path: Path, crds) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nconfigMapGenerator: []\n")
    (error,) = validate_paths([str(tmp_path)], crds)[str(tmp_path)]
    assert "configMapGenerator is not supported offline" in error


def test_a_kustomization_patches_its_targets_and_renames(tmp_path: Path) -> None:
    base, overlay = tmp_path / "base", tmp_path / "overlay"
    base.mkdir()
    overlay.mkdir()
    cfg = {"name": "cfg", "labels": {"t": "a"}}
    maps = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": cfg, "data": {"k": "1"}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "other"},
            "data": {"k": "1"},
        },
    ]
    (base / "maps.yaml").write_text(yaml.safe_dump_all(maps))
    (base / "kustomization.yaml").write_text("resources: [maps.yaml]\n")
    ops = [{"op": "replace", "path": "/data/k", "value": "2"}]
    merge = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "other"},
             "data": {"j": "3"}}  # fmt: skip
    kustomization = {
        "resources": ["../base"],
        "namePrefix": "dev-",
        "namespace": "team",
        "patches": [
            {"target": {"kind": "ConfigMap", "labelSelector": "t=a"}, "patch": yaml.safe_dump(ops)},
            {"patch": yaml.safe_dump(merge)},  # no target: the resource it names
        ],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    built = build(overlay)
    assert [d["metadata"]["name"] for d in built] == ["dev-cfg", "dev-other"]
    assert {d["metadata"]["namespace"] for d in built} == {"team"}
    assert built[0]["data"] == {"k": "2"} and built[1]["data"] == {"k": "1", "j": "3"}


@pytest.mark.parametrize(
    "kustomization,message",
    [
        ({"resources": ["missing.yaml"]}, "resource missing.yaml does not exist"),
        ({"resources": ["https://example.com/x.yaml"]}, "remote resource https://example.com/x.yaml"),
        ({"resources": ["."]}, "kustomization resources nest too deep (a cycle?)"),
        ({"patches": [{"path": "p.yaml", "patch": "{}"}]}, "needs exactly one of path or patch"),
        ({"resources": ["cm.yaml"], "patches": [{"patch": "[]"}]}, "a JSON 6902 patch needs"),
        (
            {"resources": ["cm.yaml"],
             "patches": [{"patch": "apiVersion: v1\nkind: Secret\nmetadata: {name: c}\n"}]},
            "the patch matches no resource",
        ),
    ],
)  # fmt: skip
def test_kustomizations_it_cannot_build_are_errors(tmp_path: Path, kustomization, message) -> None:
    (tmp_path / "cm.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\n")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    with pytest.raises(ManifestError, match=re.escape(message)):
        build(tmp_path)
