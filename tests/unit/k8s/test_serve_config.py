"""A RayService's embedded Serve config (``rayhf.k8s.serve_config``): Ray Serve's own schema,
plus the keys Serve would silently ignore."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from rayhf.k8s import CRDSet, validate_document
from rayhf.k8s.render import render
from rayhf.k8s.serve_config import serve_config_errors

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("RAYHF_SHARED_DIR", REPO / ".." / "shared"))
CRD_DIR = SHARED / "kuberay-crds" / "v1.7.0"
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


def _errors(doc: dict, crds: CRDSet) -> list[str]:
    return validate_document(copy.deepcopy(doc), crds)


def _one_error(doc: dict, crds: CRDSet) -> str:
    errors = _errors(doc, crds)
    assert len(errors) == 1, errors
    return errors[0]


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


def test_only_a_rayservice_s_yaml_mapping_reaches_ray_serve() -> None:
    assert serve_config_errors({"kind": "RayJob", "spec": {"serveConfigV2": "x: ["}}) == []
    assert serve_config_errors({"kind": "RayService", "spec": {}}) == []
    listed = {"kind": "RayService", "spec": {"serveConfigV2": "- a\n- b\n"}}
    assert serve_config_errors(listed) == [
        "spec.serveConfigV2: must be a YAML mapping with an 'applications' list"
    ]


def test_unknown_keys_are_found_in_nested_models_but_not_in_free_form_ones() -> None:
    app = {
        "import_path": "m:app",
        "route_prefx": "/",
        "runtime_env": {"anything": 1},  # free-form: any key is meant
        "args": {"whatever": 2},
        "deployments": [{"name": "D", "user_confg": {}}],
    }
    config = {"applications": [app], "http_options": {"hots": "0"}}
    errors = serve_config_errors(
        {"kind": "RayService", "spec": {"serveConfigV2": yaml.safe_dump(config)}}
    )
    assert sorted(errors) == [
        f"spec.serveConfigV2: {where}: unknown key (Ray Serve would silently ignore it)"
        for where in (
            "applications[0].deployments[0].user_confg",
            "applications[0].route_prefx",
            "http_options.hots",
        )
    ]
