"""Validate KubeRay manifests offline: files, directories and kustomizations of them.

For each document::

    (apiVersion, kind) -> CRD schema          not served by the CRDs -> skipped, with the reason
    normalize (nulls, defaults)  -> schema errors (rayhf.k8s.schema) + ObjectMeta errors
                                 -> Serve config errors (RayService, rayhf.k8s.serve_config)
    no errors so far             -> KubeRay's rules (rayhf.k8s.kuberay)

KubeRay's rules run only on a schema-valid object, as the operator only ever sees those. Every
error starts with the field path (``spec.workerGroupSpecs[0].replicas: ...``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rayhf.k8s.grammar import (
    dns1123_label_error,
    dns1123_subdomain_error,
    label_value_error,
    qualified_name_error,
)
from rayhf.k8s.kuberay import kuberay_errors
from rayhf.k8s.schema import CRDSet, normalize, validate_object
from rayhf.k8s.serve_config import serve_config_errors
from rayhf.k8s.yamlio import KUSTOMIZATION_FILES, ManifestError, parse_documents, read_text

MAX_ANNOTATIONS_BYTES = 256 * 1024


@dataclass(frozen=True)
class DocumentReport:
    """The verdict on one document of a file or kustomization."""

    source: str  # the path given (file, directory, or "-" for stdin)
    index: int  # position among the documents of ``source``
    kind: str
    name: str
    errors: tuple[str, ...] = ()
    skipped: str | None = None  # why the document was not validated

    @property
    def label(self) -> str:
        return f"{self.kind or '?'} {self.name or '?'}"


def validate_document(doc: Any, crds: CRDSet) -> list[str]:
    """Every error in one manifest document, as the API server and KubeRay would find them."""
    if not isinstance(doc, dict):
        return [f"(document): must be a mapping with apiVersion and kind, got {type(doc).__name__}"]
    api_version, kind = str(doc.get("apiVersion")), str(doc.get("kind"))
    schema = crds.schema_for(api_version, kind)
    if schema is None:
        served = sorted(v for v, k in crds.schemas if k == kind)
        if served:
            return [
                f"apiVersion: {api_version} is not served for {kind}; use {' or '.join(served)}"
            ]
        kinds = ", ".join(sorted({k for _, k in crds.schemas}))
        return [f"kind: no CRD for {api_version} {kind}; the CRDs define {kinds}"]
    normalized = normalize(doc, schema)
    errors = validate_object(normalized, schema)
    errors += metadata_errors(normalized.get("metadata"))
    errors += serve_config_errors(normalized)
    if not errors:
        errors += kuberay_errors(normalized)
    return errors


def skip_reason(doc: dict[str, Any], crds: CRDSet) -> str | None:
    """Why ``doc`` has no schema here (None when it has one)."""
    api_version, kind = str(doc.get("apiVersion")), str(doc.get("kind"))
    if crds.schema_for(api_version, kind) is not None:
        return None
    return f"no CRD for {api_version} {kind} here (left to other checks)"


def metadata_errors(meta: Any) -> list[str]:
    """ObjectMeta rules the API server applies to every object (name, namespace, labels)."""
    if not isinstance(meta, dict):
        return ["metadata.name: required field is missing"] if meta is None else []
    errors = []
    name = meta.get("name")
    if not name and not meta.get("generateName"):
        errors.append("metadata.name: required field is missing")
    elif isinstance(name, str) and name:
        why = dns1123_subdomain_error(name)
        errors += [f"metadata.name: {name!r} {why}"] if why else []
    namespace = meta.get("namespace")
    if isinstance(namespace, str) and dns1123_label_error(namespace):
        errors.append(f"metadata.namespace: {namespace!r} {dns1123_label_error(namespace)}")
    errors += _key_errors(meta.get("labels"), "metadata.labels", check_values=True)
    annotations = meta.get("annotations")
    errors += _key_errors(annotations, "metadata.annotations", check_values=False)
    if isinstance(annotations, dict):
        size = sum(len(str(k)) + len(str(v)) for k, v in annotations.items())
        if size > MAX_ANNOTATIONS_BYTES:
            errors.append(f"metadata.annotations: {size} bytes, more than the 256 KiB allowed")
    return errors


def _key_errors(mapping: Any, path: str, check_values: bool) -> list[str]:
    if not isinstance(mapping, dict):
        return []
    errors = []
    for key, value in mapping.items():
        why = qualified_name_error(str(key))
        if why:
            errors.append(f"{path}[{key}]: invalid key: {why}")
        why_value = label_value_error(value) if check_values and isinstance(value, str) else None
        if why_value:
            errors.append(f"{path}[{key}]: invalid value {value!r}: {why_value}")
    return errors


Loaded = tuple[str, list[Any], str | None]  # (source, documents, error that stopped reading)


def _documents(path: str) -> Iterator[Loaded]:
    """Documents of a file, "-", a kustomization, or a directory tree of them."""
    p = Path(path)
    if path != "-" and p.is_dir():
        yield from _directory_documents(p)
    else:
        yield _load(path, functools.partial(_parse_file, path))


def _load(source: str, read: Callable[[], list[Any]]) -> Loaded:
    try:
        return source, read(), None
    except ManifestError as e:
        return source, [], str(e)


def _directory_documents(directory: Path) -> Iterator[Loaded]:
    from rayhf.k8s.kustomize import build

    if any((directory / name).is_file() for name in KUSTOMIZATION_FILES):
        yield _load(str(directory), lambda: build(directory))
        return
    for child in sorted(directory.iterdir()):
        if child.is_dir():
            yield from _directory_documents(child)
        elif child.suffix in (".yaml", ".yml"):
            yield _load(str(child), functools.partial(_parse_file, str(child)))


def _parse_file(path: str) -> list[Any]:
    return parse_documents(read_text(path), path)


def _report(source: str, index: int, doc: Any, crds: CRDSet) -> DocumentReport:
    if not isinstance(doc, dict):
        return DocumentReport(source, index, "", "", tuple(validate_document(doc, crds)))
    meta = doc["metadata"] if isinstance(doc.get("metadata"), dict) else {}
    kind, name = str(doc.get("kind") or ""), str(meta.get("name") or "")
    reason = skip_reason(doc, crds)
    if reason is not None and not _claims_crd_group(doc, crds):
        return DocumentReport(source, index, kind, name, skipped=reason)
    return DocumentReport(source, index, kind, name, tuple(validate_document(doc, crds)))


def _claims_crd_group(doc: dict[str, Any], crds: CRDSet) -> bool:
    """A document of the CRDs' API group (e.g. ray.io/v2) is an error, not someone else's kind."""
    group = str(doc.get("apiVersion", "")).split("/")[0]
    return any(version.split("/")[0] == group for version, _ in crds.schemas)


def check_paths(paths: Iterable[str], crds: CRDSet | None = None) -> list[DocumentReport]:
    """One report per document in ``paths`` (files, directories, kustomizations, "-")."""
    crds = crds if crds is not None else CRDSet.load()
    reports = []
    for path in paths:
        for source, docs, error in _documents(path):
            if error is not None:
                reports.append(DocumentReport(source, 0, "", "", (error,)))
            elif not docs:
                reports.append(DocumentReport(source, 0, "", "", skipped="no documents"))
            reports += [_report(source, i, doc, crds) for i, doc in enumerate(docs)]
    return reports


def validate_paths(paths: Iterable[str], crds: CRDSet | None = None) -> dict[str, list[str]]:
    """Errors per file (or kustomization), each as ``Kind name: field.path: message``."""
    out: dict[str, list[str]] = {}
    for report in check_paths(paths, crds):
        errors = out.setdefault(report.source, [])
        errors += [f"{report.label}: {e}" if report.kind else e for e in report.errors]
    return out
