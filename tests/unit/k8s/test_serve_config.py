"""A RayService's embedded Serve config (``rayhf.k8s.serve_config``): Ray Serve's own schema,
plus the keys Serve would silently ignore."""

from __future__ import annotations

import copy

import yaml
from k8s_support import K8S_MARKS, _one_error
from k8s_support import crds as crds
from k8s_support import rendered as rendered

from rayhf.k8s import CRDSet
from rayhf.k8s.serve_config import serve_config_errors

pytestmark = K8S_MARKS


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
