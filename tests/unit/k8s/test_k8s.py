"""KubeRay manifests: the shipped and rendered ones validate, KubeRay's samples validate, and
broken manifests fail with the field path. No Ray is started (Serve's schema is only imported)."""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from rayhf.errors import RayhfError
from rayhf.k8s import CRDSet, check_paths, validate_document, validate_paths
from rayhf.k8s.cel import evaluate
from rayhf.k8s.cli import app
from rayhf.k8s.grammar import parse_quantity
from rayhf.k8s.kustomize import apply_json6902, build, strategic_merge
from rayhf.k8s.render import SERVE_IMPORT_PATH, parse_cluster, render, write_manifests

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("RAYHF_SHARED_DIR", REPO / ".." / "shared"))
CRD_DIR = SHARED / "kuberay-crds" / "v1.7.0"
SAMPLES = sorted((SHARED / "kuberay-samples").glob("*.yaml"))
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"
CHECKPOINT = "/mnt/rayhf/runs/ppo-tiny/checkpoints/step_000120/actor"

# CI always has shared/ beside the clone: there a missing CRD folder is a failure, not a skip
if os.environ.get("CI") and not CRD_DIR.is_dir():
    raise RuntimeError(f"KubeRay CRDs not found at {CRD_DIR}; set RAYHF_SHARED_DIR")

pytestmark = [
    pytest.mark.skipif(
        not CRD_DIR.is_dir(), reason=f"KubeRay CRDs not found at {CRD_DIR} (set RAYHF_SHARED_DIR)"
    ),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),  # Ray Serve's pydantic use
]


@pytest.fixture(scope="session")
def crds() -> CRDSet:
    return CRDSet.load(CRD_DIR)


@pytest.fixture(scope="session")
def rendered() -> list[dict]:
    return render(
        EXAMPLE, "2x8xH100", "me/rayhf:1", checkpoint=CHECKPOINT, storage_claim="rayhf-storage"
    )


def _ray_docs(path: Path) -> list[dict]:
    docs = yaml.safe_load_all(path.read_text())
    return [d for d in docs if isinstance(d, dict) and d.get("apiVersion") == "ray.io/v1"]


def _errors(doc: dict, crds: CRDSet) -> list[str]:
    return validate_document(copy.deepcopy(doc), crds)


def _one_error(doc: dict, crds: CRDSet) -> str:
    errors = _errors(doc, crds)
    assert len(errors) == 1, errors
    return errors[0]


# ---------------------------------------------------------------- KubeRay's own samples


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


# ---------------------------------------------------------------- shipped k8s/ manifests


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
    dev = docs["RayCluster"]["spec"]["workerGroupSpecs"][0]
    assert dev["maxReplicas"] == workers
    assert dev["template"]["spec"]["containers"][0]["resources"]["limits"] == limits


# ---------------------------------------------------------------- render


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
    ]
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
    bad.write_text(EXAMPLE.read_text().replace("steps: 120", "stepz: 120"))
    with pytest.raises(RayhfError, match="stepz"):
        render(bad, "1x8")


# ---------------------------------------------------------------- broken manifests


@pytest.fixture
def job(rendered: list[dict]) -> dict:
    return copy.deepcopy(next(d for d in rendered if d["kind"] == "RayJob"))


WORKER = "spec.rayClusterSpec.workerGroupSpecs[0]"
CONTAINER = f"{WORKER}.template.spec.containers[0]"


def _worker(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


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


def test_bad_serve_config_fails(rendered: list[dict], crds: CRDSet) -> None:
    service = copy.deepcopy(next(d for d in rendered if d["kind"] == "RayService"))
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    config["applications"][0]["deployments"] = [{"name": "PolicyServer", "num_replica": 2}]
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert _one_error(service, crds) == (
        "spec.serveConfigV2: applications[0].deployments[0].num_replica: unknown key "
        "(Ray Serve would silently ignore it)"
    )
    config["applications"][0]["deployments"] = [{"name": "PolicyServer", "num_replicas": -1}]
    service["spec"]["serveConfigV2"] = yaml.safe_dump(config)
    assert _one_error(service, crds).startswith(
        "spec.serveConfigV2: applications[0].deployments[0].num_replicas"
    )
    service["spec"]["serveConfigV2"] = "applications: [unclosed"
    assert _one_error(service, crds).startswith("spec.serveConfigV2: not valid YAML")


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


def test_nulls_and_defaults_behave_like_the_api_server(job: dict, crds: CRDSet) -> None:
    del _worker(job)["minReplicas"]  # required, but defaulted to 0 first
    _worker(job)["maxReplicas"] = None  # dropped, then defaulted to 2147483647
    job["spec"]["backoffLimit"] = None
    assert _errors(job, crds) == []


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


def test_duplicate_yaml_keys_are_errors(tmp_path: Path, crds: CRDSet) -> None:
    file = tmp_path / "dup.yaml"
    file.write_text("apiVersion: ray.io/v1\nkind: RayCluster\nkind: RayJob\n")
    (error,) = validate_paths([str(file)], crds)[str(file)]
    assert "duplicate key 'kind'" in error and "line 3" in error


# ---------------------------------------------------------------- the parts


def test_quantity_grammar() -> None:
    assert parse_quantity("500m") == parse_quantity("0.5") == parse_quantity(".5")
    assert parse_quantity("2Gi") == 2 * 1024**3 and parse_quantity("1e3") == 1000 == parse_quantity(
        1000
    )
    assert parse_quantity("1E-3") == parse_quantity("1m") and parse_quantity("+4") == 4
    for bad in ("2GB", "1e2.5", "", "1.2.3", "Gi", "1 Gi", 0.5, True, None):
        assert parse_quantity(bad) is None, bad


def test_every_crd_rule_is_evaluated_or_is_a_transition_rule(crds: CRDSet) -> None:
    rules: list[str] = []

    def walk(schema: dict) -> None:
        rules.extend(r["rule"] for r in schema.get("x-kubernetes-validations", ()))
        for child in [*schema.get("properties", {}).values(), schema.get("items")]:
            if isinstance(child, dict):
                walk(child)

    for schema in crds.schemas.values():
        walk(schema)
    assert len(rules) > 10
    for rule in rules:
        assert ("oldSelf" in rule) == (evaluate(rule, {"a": 1}) is None), rule
    both = "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))"
    assert evaluate(both, {"onSuccess": {}, "onFailure": {}}) is True
    assert evaluate(both, {"onSuccess": {}}) is False
    assert evaluate("self in ['a', 'b']", "b") is True and evaluate("self in ['a']", "c") is False


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


# ---------------------------------------------------------------- CLI


def test_cli_render_then_validate(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["render", str(EXAMPLE), "--cluster", "1x2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) == 3 and (out / "rayjob-ppo-tiny.yaml").is_file()
    result = runner.invoke(app, ["validate", str(out), "--crds", str(CRD_DIR)])
    assert result.exit_code == 0, result.output
    assert f"{out / 'rayjob-ppo-tiny.yaml'}: OK (1 validated)" in result.output
    assert "skipped 1 ConfigMap" in result.output


def test_cli_validate_reports_errors_and_exit_code(job: dict, tmp_path: Path) -> None:
    _worker(job)["replicas"] = "two"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(app, ["validate", str(bad), "--crds", str(CRD_DIR)])
    assert result.exit_code == 1
    assert f"{bad}: RayJob ppo-tiny: {WORKER}.replicas: must be an integer" in result.output
    result = CliRunner().invoke(
        app, ["validate", str(tmp_path / "missing.yaml"), "--crds", str(CRD_DIR)]
    )
    assert isinstance(result.exception, RayhfError) and "no such file" in str(result.exception)
