"""Build a kustomization offline, for the subset of kustomize that rayhf's manifests use.

Supported fields: ``resources`` (files and kustomization directories), ``patches`` (inline or
file, JSON 6902 or strategic merge, with a ``target`` selector), ``patchesJson6902``,
``patchesStrategicMerge``, ``namespace``, ``namePrefix`` and ``nameSuffix``. Anything else
(generators, remote bases, ``images``, label transformers...) is refused with a message naming
the field, rather than silently validating something kustomize would build differently; for
those, pipe ``kustomize build DIR`` into ``rayhf k8s validate -``.

Strategic merge on a custom resource follows kustomize (kyaml) there: it has no schema for the
CRD, so maps merge, ``null`` deletes, and a list merges by an inferred key (``name``,
``containerPort``, ``mountPath``, ... when every element has it) and is replaced otherwise. A
worker group list (keyed by ``groupName``) is therefore *replaced*: patch it with JSON 6902.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from rayhf.k8s.yamlio import KUSTOMIZATION_FILES, ManifestError, parse_documents, read_text

SUPPORTED_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "patches",
    "patchesJson6902",
    "patchesStrategicMerge",
    "namespace",
    "namePrefix",
    "nameSuffix",
}
ASSOCIATIVE_KEYS = ("mountPath", "devicePath", "ip", "type", "topologyKey", "name", "containerPort")
_MAX_DEPTH = 20


def build(directory: str | Path, depth: int = 0) -> list[Any]:
    """The documents ``kustomize build directory`` would print (for the supported subset)."""
    directory = Path(directory)
    if depth > _MAX_DEPTH:
        raise ManifestError(f"{directory}: kustomization resources nest too deep (a cycle?)")
    spec = _read_kustomization(directory)
    unsupported = sorted(set(spec) - SUPPORTED_FIELDS)
    if unsupported:
        raise ManifestError(
            f"{directory}: kustomization field {unsupported[0]} is not supported offline; "
            f"validate `kustomize build {directory}` output with `rayhf k8s validate -`"
        )
    docs: list[Any] = []
    for entry in spec.get("resources") or []:
        docs += _resource(directory, str(entry), depth)
    for patch, target, origin in _patches(directory, spec):
        docs = _apply_patch(docs, patch, target, origin)
    return [_rename(doc, spec) for doc in docs]


def _read_kustomization(directory: Path) -> dict[str, Any]:
    for name in KUSTOMIZATION_FILES:
        file = directory / name
        if file.is_file():
            docs = parse_documents(read_text(str(file)), str(file))
            if len(docs) != 1 or not isinstance(docs[0], dict):
                raise ManifestError(f"{file}: must hold one YAML mapping")
            return docs[0]
    raise ManifestError(f"{directory}: no kustomization.yaml in this directory")


def _resource(directory: Path, entry: str, depth: int) -> list[Any]:
    if "://" in entry or entry.startswith("github.com/"):
        raise ManifestError(f"{directory}: remote resource {entry} is not supported offline")
    path = directory / entry
    if path.is_dir():
        return build(path, depth + 1)
    if not path.is_file():
        raise ManifestError(f"{directory}: resource {entry} does not exist")
    return parse_documents(read_text(str(path)), str(path))


def _patches(directory: Path, spec: dict[str, Any]) -> list[tuple[Any, dict, str]]:
    """(patch body, target selector, where it came from) for every patch, in kustomize order."""
    out = []
    for item in spec.get("patches") or []:
        out.append((*_patch_body(directory, item), item.get("target") or {}))
    for item in spec.get("patchesStrategicMerge") or []:
        inline = isinstance(item, str) and "\n" in item
        out.append((*_patch_body(directory, {"patch" if inline else "path": item}), {}))
    for item in spec.get("patchesJson6902") or []:
        out.append((*_patch_body(directory, item), item.get("target") or {}))
    return [(body, target, origin) for body, origin, target in out]


def _patch_body(directory: Path, item: Any) -> tuple[Any, str]:
    if not isinstance(item, dict) or ("path" in item) == ("patch" in item):
        raise ManifestError(f"{directory}: each patch needs exactly one of path or patch")
    if "path" in item:
        origin = str(directory / item["path"])
        if not Path(origin).is_file():
            raise ManifestError(f"{directory}: patch file {item['path']} does not exist")
        text = read_text(origin)
    else:
        origin, text = f"{directory} (inline patch)", str(item["patch"])
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ManifestError(f"{origin}: not valid YAML: {' '.join(str(e).split())}") from None
    return body, origin


def _matches(doc: Any, target: dict[str, Any]) -> bool:
    if not isinstance(doc, dict):
        return False
    group, _, version = str(doc.get("apiVersion", "")).rpartition("/")
    meta = doc.get("metadata") or {}
    fields = {
        "group": group,
        "version": version,
        "kind": doc.get("kind"),
        "name": meta.get("name"),
        "namespace": meta.get("namespace") or "",
    }
    for key, wanted in target.items():
        if wanted is None:
            continue
        if key == "labelSelector":
            if not _labels_match(meta.get("labels") or {}, str(wanted)):
                return False
        elif key not in fields:
            raise ManifestError(f"patch target field {key} is not supported offline")
        elif not re.fullmatch(str(wanted), str(fields[key] or "")):
            return False
    return True


def _labels_match(labels: dict[str, Any], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if not sep or key.endswith("!"):
            raise ManifestError(f"labelSelector {selector!r}: only key=value terms are supported")
        if str(labels.get(key.strip())) != value.lstrip("=").strip():
            return False
    return True


def _apply_patch(docs: list[Any], patch: Any, target: dict, origin: str) -> list[Any]:
    if isinstance(patch, dict) and not target:
        meta = patch.get("metadata") or {}
        group, _, version = str(patch.get("apiVersion", "")).rpartition("/")
        target = {"group": group, "version": version, "kind": patch.get("kind")}
        target["name"] = re.escape(str(meta.get("name", "")))
    if not isinstance(patch, dict | list):
        raise ManifestError(f"{origin}: a patch is a mapping (strategic merge) or a list of ops")
    if isinstance(patch, list) and not target:
        raise ManifestError(f"{origin}: a JSON 6902 patch needs a target (kind, name...)")
    hits = [i for i, doc in enumerate(docs) if _matches(doc, target)]
    if not hits:
        raise ManifestError(f"{origin}: the patch matches no resource (target {target})")
    out = list(docs)
    for i in hits:
        if isinstance(patch, list):
            out[i] = apply_json6902(docs[i], patch, origin)
        else:
            out[i] = strategic_merge(docs[i], _without_identity(patch))
    return out


def _without_identity(patch: dict[str, Any]) -> dict[str, Any]:
    """A strategic merge patch minus the fields that only say which resource it is for."""
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    meta = {
        k: v for k, v in (patch.get("metadata") or {}).items() if k not in ("name", "namespace")
    }
    body.pop("metadata", None)
    return {**body, "metadata": meta} if meta else body


def _rename(doc: Any, spec: dict[str, Any]) -> Any:
    if not isinstance(doc, dict) or not any(
        spec.get(k) for k in ("namePrefix", "nameSuffix", "namespace")
    ):
        return doc
    doc = copy.deepcopy(doc)
    meta = doc.setdefault("metadata", {})
    if spec.get("namePrefix") or spec.get("nameSuffix"):
        meta["name"] = (
            f"{spec.get('namePrefix', '')}{meta.get('name', '')}{spec.get('nameSuffix', '')}"
        )
    if spec.get("namespace"):
        meta["namespace"] = spec["namespace"]
    return doc


def _pointer(path: str, origin: str) -> list[str]:
    if path and not path.startswith("/"):
        raise ManifestError(f"{origin}: JSON pointer {path!r} must start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]]


def _resolve(doc: Any, parts: list[str], origin: str) -> tuple[Any, str]:
    """(container, last key) for a pointer; the container must exist."""
    node = doc
    for part in parts[:-1]:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ManifestError(f"{origin}: path /{'/'.join(parts)} does not exist") from None
    return node, parts[-1]


def _get(doc: Any, path: str, origin: str) -> Any:
    parts = _pointer(path, origin)
    if not parts:
        return doc
    node, key = _resolve(doc, parts, origin)
    try:
        return node[int(key)] if isinstance(node, list) else node[key]
    except (KeyError, IndexError, ValueError, TypeError):
        raise ManifestError(f"{origin}: path {path} does not exist") from None


def _set(doc: Any, path: str, value: Any, origin: str, insert: bool) -> None:
    node, key = _resolve(doc, _pointer(path, origin), origin)
    if isinstance(node, dict):
        if not insert and key not in node:
            raise ManifestError(f"{origin}: cannot replace {path}: it does not exist")
        node[key] = value
    elif isinstance(node, list) and insert and (key == "-" or key.isdigit()):
        node.insert(len(node) if key == "-" else int(key), value)
    elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
        node[int(key)] = value
    else:
        raise ManifestError(f"{origin}: cannot set {path}")


def _remove(doc: Any, path: str, origin: str) -> Any:
    value = _get(doc, path, origin)
    node, key = _resolve(doc, _pointer(path, origin), origin)
    del node[int(key) if isinstance(node, list) else key]
    return value


def apply_json6902(doc: Any, ops: list[Any], origin: str) -> Any:
    """``doc`` with RFC 6902 operations applied (add, remove, replace, move, copy, test)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ManifestError(f"{origin}: each JSON patch operation needs op and path")
        kind, path = op["op"], str(op["path"])
        if kind in ("add", "replace"):
            _set(doc, path, copy.deepcopy(op.get("value")), origin, insert=kind == "add")
        elif kind == "remove":
            _remove(doc, path, origin)
        elif kind in ("move", "copy"):
            source = str(op.get("from", ""))
            value = _remove(doc, source, origin) if kind == "move" else _get(doc, source, origin)
            _set(doc, path, copy.deepcopy(value), origin, insert=True)
        elif kind == "test":
            if _get(doc, path, origin) != op.get("value"):
                raise ManifestError(f"{origin}: test failed at {path}")
        else:
            raise ManifestError(f"{origin}: unknown JSON patch op {kind!r}")
    return doc


def _associative_key(items: list[Any]) -> str | None:
    if not items or not all(isinstance(item, dict) for item in items):
        return None
    return next((k for k in ASSOCIATIVE_KEYS if all(k in item for item in items)), None)


def strategic_merge(target: Any, patch: Any) -> Any:
    """``patch`` merged into ``target`` the way kustomize does it for a custom resource."""
    if isinstance(target, dict) and isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        out = dict(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = strategic_merge(out[key], value) if key in out else copy.deepcopy(value)
        return out
    if isinstance(target, list) and isinstance(patch, list):
        key = _associative_key(target + patch)
        if key is None:
            return copy.deepcopy(patch)
        merged = list(target)
        for item in patch:
            at = next((i for i, old in enumerate(merged) if old[key] == item[key]), None)
            if item.get("$patch") == "delete":
                merged = [old for old in merged if old[key] != item[key]]
            elif at is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[at] = strategic_merge(merged[at], item)
        return merged
    return copy.deepcopy(patch)
