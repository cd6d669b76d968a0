"""What the k8s tests share: where the KubeRay CRDs and the example run are, the marks that skip a
module without the CRDs, the ``crds``/``rendered``/``job`` fixtures and small document helpers.

A test module imports the fixtures it uses (``from k8s_support import crds as crds``: the alias
marks the re-export, so ruff does not call it unused) and sets ``pytestmark = K8S_MARKS``.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from rayhf.k8s import CRDSet, validate_document
from rayhf.k8s.render import render

REPO = Path(__file__).resolve().parents[3]
SHARED = Path(os.environ.get("RAYHF_SHARED_DIR", REPO / ".." / "shared"))
CRD_DIR = SHARED / "kuberay-crds" / "v1.7.0"
EXAMPLE = REPO / "examples" / "ppo_tiny.yaml"
CHECKPOINT = "/mnt/rayhf/runs/ppo-tiny/checkpoints/step_000200/actor"

# CI always has shared/ beside the clone: there a missing CRD folder is a failure, not a skip
if os.environ.get("CI") and not CRD_DIR.is_dir():
    raise RuntimeError(f"KubeRay CRDs not found at {CRD_DIR}; set RAYHF_SHARED_DIR")

K8S_MARKS = [
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


@pytest.fixture
def job(rendered: list[dict]) -> dict:
    """The rendered RayJob, a copy of its own (needs ``rendered`` imported beside it)."""
    return copy.deepcopy(next(d for d in rendered if d["kind"] == "RayJob"))


WORKER = "spec.rayClusterSpec.workerGroupSpecs[0]"


def _worker(doc: dict) -> dict:
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def _errors(doc: dict, crds: CRDSet) -> list[str]:
    return validate_document(copy.deepcopy(doc), crds)


def _one_error(doc: dict, crds: CRDSet) -> str:
    errors = _errors(doc, crds)
    assert len(errors) == 1, errors
    return errors[0]
