"""Reading and writing manifest YAML the way kubectl reads it, and writing files atomically."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from rayhf.errors import RayhfError

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


class ManifestError(RayhfError):
    """A file that cannot be read as manifests (bad YAML, bad kustomization)."""


class _ManifestLoader(yaml.SafeLoader):
    """YAML as kubectl reads it: duplicate keys are errors, timestamps stay strings."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if not isinstance(key, Hashable):
                continue  # a complex key; PyYAML reports it below
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_ManifestLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def parse_documents(text: str, source: str) -> list[Any]:
    """The non-empty documents of a multi-document YAML text; ``v1 List`` items are expanded."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_ManifestLoader) if d is not None]
    except yaml.YAMLError as e:
        raise ManifestError(f"{source}: not valid YAML: {' '.join(str(e).split())}") from None
    out: list[Any] = []
    for doc in docs:
        is_list = isinstance(doc, dict) and doc.get("kind") == "List"
        out.extend((doc.get("items") or []) if is_list else [doc])
    return out


def read_text(path: str) -> str:
    """The text of ``path`` ("-" is stdin); RayhfError when it cannot be read."""
    if path == "-":
        return sys.stdin.read()
    p = Path(path)
    if not p.is_file():
        raise RayhfError(f"{path}: no such file or directory")
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise RayhfError(f"{path}: cannot read it ({e.__class__.__name__})") from None


class _ManifestDumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2, a config file) as readable ``|`` blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _represent_str)


def dump_documents(docs: list[dict[str, Any]]) -> str:
    """Multi-document YAML, keys in the order written (apiVersion, kind, metadata, spec)."""
    return "---\n".join(
        yaml.dump(doc, Dumper=_ManifestDumper, sort_keys=False, width=4096) for doc in docs
    )


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
