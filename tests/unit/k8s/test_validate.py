"""Validating KubeRay manifests (``rayhf.k8s.validate``): KubeRay's samples and the shipped
manifests validate, broken manifests fail with the field path. No Ray is started (Serve's schema
is only imported)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from k8s_support import K8S_MARKS, REPO, SHARED, WORKER, _errors, _one_error, _worker
from k8s_support import crds as crds
from k8s_support import job as job
from k8s_support import rendered as rendered

from rayhf.k8s import CRDSet, check_paths, validate_document, validate_paths
from rayhf.k8s.validate import metadata_errors

SAMPLES = sorted((SHARED / "kuberay-samples").glob("*.yaml"))

pytestmark = K8S_MARKS


def _ray_docs(path: Path) -> list[dict]:
    docs = yaml.safe_load_all(path.read_text())
    return [d for d in docs if isinstance(d, dict) and d.get("apiVersion") == "ray.io/v1"]


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_every_kuberay_sample_is_valid(sample: Path, crds: CRDSet) -> None:
    reports = check_paths([str(sample)], crds)
    assert [e for r in reports for e in r.errors] == []
    validated = [r for r in reports if r.skipped is None]
    assert len(validated) == len(_ray_docs(sample))
    for doc in _ray_docs(sample):  # ... and the validator does look inside each of them
        broken = copy.deepcopy(doc)
        pod = _first_pod_spec(broken)
        pod["containers"][0]["imagePullPolcy"] = "Always"
        assert any(
            e.endswith("containers[0].imagePullPolcy: unknown field 'imagePullPolcy'")
            for e in _errors(broken, crds)
        )


def _first_pod_spec(doc: dict) -> dict:
    spec = doc["spec"]
    cluster = {
        "RayCluster": lambda: spec,
        "RayJob": lambda: spec.get("rayClusterSpec") or {},
        "RayService": lambda: spec["rayClusterConfig"],
        "RayCronJob": lambda: spec["jobTemplate"]["rayClusterSpec"],
    }[doc["kind"]]()
    if not cluster:  # a RayJob on an existing cluster: break its submitter pod instead
        spec["submitterPodTemplate"] = {"spec": {"containers": [{"name": "s", "image": "i"}]}}
        return spec["submitterPodTemplate"]["spec"]
    return cluster["headGroupSpec"]["template"]["spec"]


def test_all_sample_documents_are_counted(crds: CRDSet) -> None:
    reports = check_paths([str(p) for p in SAMPLES], crds)
    validated = [r for r in reports if r.skipped is None]
    expected = sum(len(_ray_docs(p)) for p in SAMPLES)
    assert len(validated) == expected >= 89
    assert {r.kind for r in validated} == {"RayCluster", "RayJob", "RayService", "RayCronJob"}
    skipped = {r.kind for r in reports if r.skipped is not None}
    assert {"ConfigMap", "Secret", "Ingress"} <= skipped


def test_shipped_manifests_are_valid(crds: CRDSet) -> None:
    result = validate_paths([str(REPO / "k8s")], crds)
    assert set(result) == {
        str(REPO / "k8s" / d) for d in ("base", "overlays/small", "overlays/large")
    }
    assert all(errors == [] for errors in result.values()), result
    validated = [r for r in check_paths([str(REPO / "k8s")], crds) if r.skipped is None]
    assert len(validated) == 9  # RayJob, RayCluster, RayService in base and both overlays
    for file in sorted((REPO / "k8s" / "base").glob("*.yaml")):
        assert validate_paths([str(file)], crds) == {str(file): []}


CONTAINER = f"{WORKER}.template.spec.containers[0]"


def _container(doc: dict) -> dict:
    return _worker(doc)["template"]["spec"]["containers"][0]


def test_broken_files_fail_with_the_field_path(job: dict, tmp_path: Path, crds) -> None:
    cases = {
        "unknown.yaml": (
            "spec.rayClusterSpec.headGroupSpec.bogus: unknown field 'bogus'",
            lambda d: d["spec"]["rayClusterSpec"]["headGroupSpec"].update(bogus=1),
        ),
        "type.yaml": (
            f"{WORKER}.replicas: must be an integer, got string 'two'",
            lambda d: _worker(d).update(replicas="two"),
        ),
        "quantity.yaml": (
            f"{CONTAINER}.resources.limits[memory]: '2GB' is not a valid quantity",
            lambda d: _container(d)["resources"]["limits"].update(memory="2GB"),
        ),
        "dup.yaml": (
            f'{WORKER}.template.spec.containers[1].name: duplicate value "ray-worker" '
            "for list-map key name",
            lambda d: _worker(d)["template"]["spec"]["containers"].append(
                copy.deepcopy(_container(d))
            ),
        ),
        "params.yaml": (
            f"{WORKER}.rayStartParams[num-cpus]: must be a string, got an object",
            lambda d: _worker(d).update(rayStartParams={"num-cpus": {"a": 1}}),
        ),
    }
    for name, (expected, breaks) in cases.items():
        doc = copy.deepcopy(job)
        breaks(doc)
        (tmp_path / name).write_text(yaml.safe_dump(doc))
        (error,) = validate_paths([str(tmp_path / name)], crds)[str(tmp_path / name)]
        assert error.startswith(f"RayJob ppo-tiny: {expected}"), error


@pytest.mark.parametrize(
    "breaks,expected",
    [
        (
            lambda d: _container(d)["resources"]["limits"].update(cpu=0.5),
            f"{CONTAINER}.resources.limits[cpu]: must be an integer or a string, got number 0.5",
        ),
        (
            lambda d: _container(d)["resources"]["limits"].update(cpu="1e2.5"),
            f"{CONTAINER}.resources.limits[cpu]: '1e2.5' is not a valid quantity",
        ),
        (
            lambda d: _container(d).update(env=[{"name": "A", "value": "1"}, {"name": "A"}]),
            f'{CONTAINER}.env[1].name: duplicate value "A" for list-map key name',
        ),
        (
            lambda d: _container(d).update(ports=[{"containerPort": 80}, {"containerPort": 80}]),
            f"{CONTAINER}.ports[1]: duplicate entry for list-map keys "
            'containerPort=80, protocol="TCP"',
        ),
        (
            lambda d: _worker(d).update(replicas=9),
            f"{WORKER}.replicas: 9 is outside [minReplicas, maxReplicas] = [2, 2]; "
            "KubeRay would run 2",
        ),
        (
            lambda d: _worker(d).update(replicas=2**31),
            f"{WORKER}.replicas: 2147483648 is out of the int32 range",
        ),
        (
            lambda d: d["spec"]["rayClusterSpec"]["workerGroupSpecs"].append(
                copy.deepcopy(_worker(d))
            ),
            "spec.rayClusterSpec.workerGroupSpecs[1].groupName: "
            "duplicate worker group name 'gpu-h100'",
        ),
        (
            lambda d: _worker(d)["template"]["spec"].update(containers=[]),
            f"{WORKER}.template.spec.containers: the worker group needs at least one container",
        ),
        (
            lambda d: _worker(d)["template"]["spec"].update(containers=None),
            f"{WORKER}.template.spec.containers: required field is missing",
        ),
        (
            lambda d: _container(d)["resources"]["requests"].update({"nvidia.com/gpu": "4"}),
            f"{CONTAINER}.resources.requests[nvidia.com/gpu]: nvidia.com/gpu must be set in limits",
        ),
        (
            lambda d: d["spec"].update(deletionStrategy={"onSuccess": {"policy": "DeleteCluster"}}),
            "spec.deletionStrategy: deletionStrategy requires either BOTH onSuccess and onFailure",
        ),
        (
            lambda d: d["spec"].update(submissionMode="Batch"),
            "spec.submissionMode: 'Batch' is not one of K8sJobMode",
        ),
        (
            lambda d: d["metadata"].update(name="ppo_tiny"),
            "metadata.name: 'ppo_tiny' must consist of lower case",
        ),
        (
            lambda d: d["metadata"].update(name="x" * 48),
            f"metadata.name: '{'x' * 48}' must be no more than 47 characters",
        ),
        (lambda d: d["metadata"].update(labels={"a b": "c"}), "metadata.labels[a b]: invalid key"),
        (lambda d: d["metadata"].update(nmae="x"), "metadata.nmae: unknown field 'nmae'"),
    ],
    ids=[
        "float-quantity",
        "fractional-exponent",
        "duplicate-env",
        "duplicate-port",
        "replicas-out-of-range",
        "int32-overflow",
        "duplicate-group",
        "no-container",
        "null-containers",
        "gpu-request-without-limit",
        "cel-deletion-strategy",
        "submission-mode",
        "name-not-dns",
        "name-too-long",
        "label-key",
        "metadata-typo",
    ],
)
def test_broken_rayjob_fails_with_the_field_path(job: dict, crds, breaks, expected) -> None:
    breaks(job)
    assert _one_error(job, crds).startswith(expected)


def test_documents_of_other_kinds_and_versions(job: dict, crds: CRDSet, tmp_path: Path) -> None:
    job["apiVersion"] = "ray.io/v2"
    file = tmp_path / "mixed.yaml"
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}}
    file.write_text(yaml.safe_dump_all([config_map, job]))
    skipped, wrong = check_paths([str(file)], crds)
    assert skipped.kind == "ConfigMap" and skipped.skipped and not skipped.errors
    assert wrong.errors == (
        "apiVersion: ray.io/v2 is not served for RayJob; use ray.io/v1 or ray.io/v1alpha1",
    )


# ---------------------------------------------------------------- the parts


def test_metadata_rules_of_every_object() -> None:
    assert metadata_errors({"generateName": "ppo-"}) == []
    assert metadata_errors({}) == ["metadata.name: required field is missing"]
    assert metadata_errors(None) == ["metadata.name: required field is missing"]
    (error,) = metadata_errors({"name": "a", "namespace": "Team_A"})
    assert error.startswith("metadata.namespace: 'Team_A' must consist of lower case")
    (error,) = metadata_errors({"name": "a", "labels": {"app": "-x"}})
    assert error.startswith("metadata.labels[app]: invalid value '-x'")
    assert metadata_errors({"name": "a", "annotations": {"note": "-free text, fine-"}}) == []
    big = {"name": "a", "annotations": {"blob": "x" * 256 * 1024}}
    assert metadata_errors(big) == [
        "metadata.annotations: 262148 bytes, more than the 256 KiB allowed"
    ]


def test_documents_that_are_no_object_or_have_no_crd(crds: CRDSet) -> None:
    assert validate_document(["a"], crds) == [
        "(document): must be a mapping with apiVersion and kind, got list"
    ]
    (error,) = validate_document({"apiVersion": "ray.io/v1", "kind": "RayThing"}, crds)
    assert error.startswith("kind: no CRD for ray.io/v1 RayThing; the CRDs define ")
    assert "RayCluster" in error and "RayJob" in error


def test_directories_are_walked_and_unreadable_files_reported(tmp_path: Path, crds) -> None:
    (tmp_path / "empty.yaml").write_text("# nothing here\n")
    (tmp_path / "notes.txt").write_text("kind: RayJob\n")  # not a manifest file name: not read
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "broken.yml").write_text("kind: [unclosed\n")
    reports = {Path(r.source).name: r for r in check_paths([str(tmp_path)], crds)}
    assert set(reports) == {"empty.yaml", "broken.yml"}
    assert reports["empty.yaml"].skipped == "no documents"
    (error,) = reports["broken.yml"].errors
    assert "broken.yml: not valid YAML" in error
