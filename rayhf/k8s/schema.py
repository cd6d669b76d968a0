"""Validate a custom resource against its CRD's ``openAPIV3Schema`` the way the API server does.

The API server (``k8s.io/apiextensions-apiserver``) handles a create in this order, and so does
this module:

1. fields the schema does not know are found (``kubectl apply`` asks for strict field
   validation by default, so they are errors, not silently pruned);
2. ``null`` in a non-nullable field is dropped and ``default`` values are filled in
   (``normalize``), so ``required`` and list-map keys see the defaulted object;
3. OpenAPI validation: types (``x-kubernetes-int-or-string`` included), ``enum``, ``pattern``,
   lengths, bounds, ``format`` (int32/int64 ranges, date-time), ``required``;
4. ``x-kubernetes-list-type`` ``map`` (unique key tuples) and ``set`` (unique items);
5. ``x-kubernetes-validations`` CEL rules, for the subset ``rayhf.k8s.cel`` evaluates.

Resource quantities (every field controller-gen marks with the quantity pattern) are checked with
the quantity grammar of ``resource.ParseQuantity``, which is slightly stricter than the pattern.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from rayhf.errors import RayhfError
from rayhf.k8s.cel import evaluate
from rayhf.k8s.grammar import CRD_QUANTITY_PATTERN, QUANTITY_HINT, parse_quantity

KUBERAY_VERSION = "v1.7.0"
_REPO = Path(__file__).resolve().parents[2]
_INT_RANGES = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}
_STRING = {"type": "string"}
_STRING_MAP = {"type": "object", "additionalProperties": _STRING}
_ANY_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
# metadata of a custom resource is ObjectMeta, which the CRD schema leaves as a bare object.
OBJECT_META_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": _STRING,
        "generateName": _STRING,
        "namespace": _STRING,
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "finalizers": {"type": "array", "items": _STRING},
        "ownerReferences": {"type": "array", "items": _ANY_OBJECT},
        "managedFields": {"type": "array", "items": _ANY_OBJECT},
        "uid": _STRING,
        "resourceVersion": _STRING,
        "selfLink": _STRING,
        "generation": {"type": "integer", "format": "int64"},
        "creationTimestamp": {"type": "string", "format": "date-time", "nullable": True},
        "deletionTimestamp": {"type": "string", "format": "date-time", "nullable": True},
        "deletionGracePeriodSeconds": {"type": "integer", "format": "int64"},
    },
}


def default_crd_dir() -> Path:
    """Where the KubeRay CRDs are looked for: $RAYHF_KUBERAY_CRDS, else the shared directory."""
    explicit = os.environ.get("RAYHF_KUBERAY_CRDS")
    if explicit:
        return Path(explicit)
    shared = Path(os.environ.get("RAYHF_SHARED_DIR", _REPO.parent / "shared"))
    return shared / "kuberay-crds" / KUBERAY_VERSION


@dataclass(frozen=True)
class CRDSet:
    """The root schema of every served version of some CRDs, keyed by (apiVersion, kind)."""

    schemas: dict[tuple[str, str], dict[str, Any]]
    source: str

    @classmethod
    def load(cls, directory: str | Path | None = None) -> CRDSet:
        """Read every CustomResourceDefinition in ``directory`` (*.yaml; cached per path); with
        none given and none in ``default_crd_dir()``, KubeRay's CRDs from the cluster that
        kubectl's current context points at."""
        path = Path(directory) if directory is not None else default_crd_dir()
        if directory is None and not any(path.glob("*.yaml")) and shutil.which("kubectl"):
            return _crds_from_cluster()
        return _load_crds(str(path.resolve()))

    def schema_for(self, api_version: str, kind: str) -> dict[str, Any] | None:
        """The root schema for documents of this apiVersion and kind, or None if not served."""
        return self.schemas.get((api_version, kind))


KUBERAY_CRDS = ("rayclusters.ray.io", "rayjobs.ray.io", "rayservices.ray.io")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 4 MB of CRDs: 2 s in C, 30 s not


@functools.lru_cache(maxsize=4)
def _load_crds(directory: str) -> CRDSet:
    files = sorted(Path(directory).glob("*.yaml")) if Path(directory).is_dir() else []
    schemas = _schemas(doc for file in files for doc in yaml.load_all(file.read_text(), _LOADER))
    if not schemas:
        raise RayhfError(
            f"no CustomResourceDefinitions in {directory}: pass --crds DIR with KubeRay's CRD "
            f"files (ray-operator/config/crd/bases in a KubeRay {KUBERAY_VERSION} checkout), "
            "or install kubectl with a kubeconfig for a cluster that runs KubeRay"
        )
    return CRDSet(schemas=schemas, source=directory)


@functools.lru_cache(maxsize=1)
def _crds_from_cluster() -> CRDSet:
    """KubeRay's CRDs as the API server serves them (``kubectl get crd ... -o yaml``)."""
    cmd = ["kubectl", "get", "crd", *KUBERAY_CRDS, "-o", "yaml"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        done = subprocess.CompletedProcess(cmd, 1, "", "no answer in 60 s")
    said = (done.stderr.strip().splitlines() or ["no CRDs"])[-1]
    docs = yaml.load_all(done.stdout, _LOADER) if done.returncode == 0 else iter(())
    schemas = _schemas(item for doc in docs if isinstance(doc, dict) for item in _items(doc))
    if not schemas:
        raise RayhfError(
            f"`{' '.join(cmd)}` gave no KubeRay CRDs ({said}): pass --crds DIR with KubeRay's "
            f"CRD files (ray-operator/config/crd/bases in a KubeRay {KUBERAY_VERSION} checkout)"
        )
    return CRDSet(schemas=schemas, source="kubectl get crd")


def _items(doc: dict[str, Any]) -> list[Any]:
    """A ``kind: List``'s items, or the document itself."""
    return doc.get("items") or [] if doc.get("kind") == "List" else [doc]


def _schemas(docs: Any) -> dict[tuple[str, str], dict[str, Any]]:
    schemas: dict[tuple[str, str], dict[str, Any]] = {}
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") == "CustomResourceDefinition":
            schemas.update(_served_schemas(doc))
    return schemas


def _served_schemas(crd: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    spec = crd["spec"]
    out = {}
    for version in spec.get("versions", []):
        if not version.get("served"):
            continue
        root = dict(version["schema"]["openAPIV3Schema"])
        root["properties"] = {**root.get("properties", {}), "metadata": OBJECT_META_SCHEMA}
        out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = root
    return out


def normalize(value: Any, schema: dict[str, Any] | None) -> Any:
    """A copy of ``value`` with non-nullable nulls dropped and schema defaults filled in."""
    if schema is None:
        return value
    if isinstance(value, dict):
        return _normalize_object(value, schema)
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        items = schema["items"]
        return [_default_if_null(item, items) for item in value]
    return value


def _default_if_null(value: Any, schema: dict[str, Any]) -> Any:
    if value is None and not schema.get("nullable") and "default" in schema:
        value = copy.deepcopy(schema["default"])
    return normalize(value, schema)


def _normalize_object(value: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    out: dict[str, Any] = {}
    for key, item in value.items():
        sub = props.get(key, extra if isinstance(extra, dict) else None)
        if item is None and sub is not None and not sub.get("nullable") and "default" not in sub:
            continue  # PruneNonNullableNullsWithoutDefaults
        out[key] = _default_if_null(item, sub) if sub is not None else item
    for key, sub in props.items():
        if "default" in sub and key not in out:
            out[key] = normalize(copy.deepcopy(sub["default"]), sub)
    return out


def validate_object(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Every schema violation in ``value`` (already normalized), each prefixed by its path."""
    errors: list[str] = []
    _check(value, schema, path, errors)
    return errors


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"{'integer' if _is_int(value) else 'number'} {value}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"string {shown!r}"
    if isinstance(value, dict):
        return "an object"
    return "a list" if isinstance(value, list) else type(value).__name__


def _is_int(value: Any) -> bool:
    """JSON integers; 2.0 counts, as the API server's decoder sees no difference."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _type_error(value: Any, schema: dict[str, Any]) -> str | None:
    if schema.get("x-kubernetes-int-or-string"):
        ok = _is_int(value) or isinstance(value, str)
        return None if ok else f"must be an integer or a string, got {_describe(value)}"
    expected = str(schema.get("type"))
    checks: dict[str, Callable[[Any], bool]] = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": _is_int,
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
    }
    check = checks.get(expected)
    if check is None or check(value):
        return None
    article = "an" if expected[0] in "aeiou" else "a"
    return f"must be {article} {expected}, got {_describe(value)}"


def _check(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    if value is None:
        typed = schema.get("type") or schema.get("x-kubernetes-int-or-string")
        if typed and not schema.get("nullable"):
            errors.append(f"{path}: must not be null (give a value or remove the field)")
        return
    type_error = _type_error(value, schema)
    if type_error is not None:
        errors.append(f"{path}: {type_error}")
        return
    if isinstance(value, dict):
        _check_object(value, schema, path, errors)
    elif isinstance(value, list):
        _check_array(value, schema, path, errors)
    else:
        _check_scalar(value, schema, path, errors)
    for rule in schema.get("x-kubernetes-validations", ()):
        if evaluate(rule["rule"], value) is False:
            errors.append(f"{path}: {rule.get('message') or 'failed rule ' + rule['rule']}")


def _check_object(
    value: dict[str, Any], schema: dict[str, Any], path: str, errors: list[str]
) -> None:
    props = schema.get("properties", {})
    extra = schema.get("additionalProperties")
    keep_unknown = schema.get("x-kubernetes-preserve-unknown-fields") or extra is True
    for key, item in value.items():
        if key in props:
            _check(item, props[key], _join(path, key), errors)
        elif isinstance(extra, dict):
            _check(item, extra, f"{path}[{key}]", errors)
        elif not keep_unknown:
            errors.append(f"{_join(path, str(key))}: unknown field {str(key)!r}")
    errors.extend(
        f"{_join(path, key)}: required field is missing"
        for key in schema.get("required", ())
        if key not in value
    )
    _check_bounds(len(value), schema, "minProperties", "maxProperties", "properties", path, errors)


def _check_array(value: list[Any], schema: dict[str, Any], path: str, errors: list[str]) -> None:
    items = schema.get("items")
    if isinstance(items, dict):
        for i, item in enumerate(value):
            _check(item, items, f"{path}[{i}]", errors)
    _check_bounds(len(value), schema, "minItems", "maxItems", "items", path, errors)
    list_type = schema.get("x-kubernetes-list-type")
    if list_type == "map":
        errors.extend(list_map_errors(value, schema, path))
    elif list_type == "set":
        errors.extend(list_set_errors(value, path))


def _check_bounds(
    n: int, schema: dict[str, Any], low: str, high: str, what: str, path: str, errors: list[str]
) -> None:
    if low in schema and n < schema[low]:
        errors.append(f"{path}: must have at least {schema[low]} {what}, has {n}")
    if high in schema and n > schema[high]:
        errors.append(f"{path}: must have at most {schema[high]} {what}, has {n}")


def _check_scalar(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
        errors.append(f"{path}: unsupported value {_describe(value)}; supported values: {allowed}")
    if isinstance(value, str):
        _check_string(value, schema, path, errors)
    else:
        _check_number(value, schema, path, errors)


def _check_string(value: str, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    pattern = schema.get("pattern")
    if pattern == CRD_QUANTITY_PATTERN:
        if parse_quantity(value) is None:
            errors.append(f"{path}: {value!r} is not a valid quantity; use {QUANTITY_HINT}")
    elif pattern is not None and not re.search(pattern, value):
        errors.append(f"{path}: {value!r} does not match the pattern {pattern}")
    _check_bounds(len(value), schema, "minLength", "maxLength", "characters", path, errors)
    if schema.get("format") == "date-time" and not _is_datetime(value):
        errors.append(f"{path}: {value!r} is not an RFC 3339 date-time")


def _is_datetime(value: str) -> bool:
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return False
    return "T" in value.upper()


def _check_number(value: int | float, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{path}: must be greater than or equal to {schema['minimum']}, got {value}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{path}: must be less than or equal to {schema['maximum']}, got {value}")
    bounds = _INT_RANGES.get(schema.get("format", ""))
    if bounds is not None and not bounds[0] <= value <= bounds[1]:
        errors.append(f"{path}: {value} is out of the {schema['format']} range")


def list_map_errors(items: list[Any], schema: dict[str, Any], path: str) -> list[str]:
    """Duplicate key tuples in an ``x-kubernetes-list-type: map`` list (missing keys count)."""
    keys = schema.get("x-kubernetes-list-map-keys", [])
    item_props = schema.get("items", {}).get("properties", {})
    seen: set[str] = set()
    errors = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue  # the item's type error is already reported
        values = [item.get(k, item_props.get(k, {}).get("default")) for k in keys]
        fingerprint = repr(values)
        if fingerprint in seen:
            errors.append(_duplicate_key_message(f"{path}[{i}]", keys, values))
        seen.add(fingerprint)
    return errors


def _duplicate_key_message(path: str, keys: list[str], values: list[Any]) -> str:
    shown = [f'"{v}"' if isinstance(v, str) else str(v) for v in values]
    if len(keys) == 1:
        return f"{path}.{keys[0]}: duplicate value {shown[0]} for list-map key {keys[0]}"
    pairs = ", ".join(f"{k}={v}" for k, v in zip(keys, shown, strict=True))
    return f"{path}: duplicate entry for list-map keys {pairs}"


def list_set_errors(items: list[Any], path: str) -> list[str]:
    """Duplicate items in an ``x-kubernetes-list-type: set`` list."""
    seen: set[str] = set()
    errors = []
    for i, item in enumerate(items):
        fingerprint = repr(item)
        if fingerprint in seen:
            errors.append(f"{path}[{i}]: duplicate value {_describe(item)} in a set")
        seen.add(fingerprint)
    return errors
