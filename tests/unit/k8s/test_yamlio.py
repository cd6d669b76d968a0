"""Manifest YAML as kubectl reads it, and atomic writes (``rayhf.k8s.yamlio``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from k8s_support import K8S_MARKS
from k8s_support import crds as crds

from rayhf.errors import RayhfError
from rayhf.k8s import CRDSet, validate_paths
from rayhf.k8s.yamlio import (
    ManifestError,
    dump_documents,
    parse_documents,
    read_text,
    write_atomic,
)

pytestmark = K8S_MARKS


def test_duplicate_yaml_keys_are_errors(tmp_path: Path, crds: CRDSet) -> None:
    file = tmp_path / "dup.yaml"
    file.write_text("apiVersion: ray.io/v1\nkind: RayCluster\nkind: RayJob\n")
    (error,) = validate_paths([str(file)], crds)[str(file)]
    assert "duplicate key 'kind'" in error and "line 3" in error


def test_documents_are_read_as_kubectl_reads_them() -> None:
    text = "a: 2024-01-01\n---\n---\nkind: List\nitems:\n- {kind: A}\n- {kind: B}\n"
    assert parse_documents(text, "t") == [{"a": "2024-01-01"}, {"kind": "A"}, {"kind": "B"}]
    with pytest.raises(ManifestError, match=r"^t: not valid YAML: "):
        parse_documents("a: [", "t")


def test_dumped_documents_keep_key_order_and_block_strings() -> None:
    docs = [{"kind": "ConfigMap", "apiVersion": "v1", "data": {"f.yaml": "a: 1\nb: 2\n"}}]
    text = dump_documents([*docs, {"kind": "B"}])
    assert text.startswith("kind: ConfigMap\napiVersion: v1\n")
    assert "f.yaml: |\n    a: 1\n    b: 2\n---\nkind: B\n" in text
    assert list(yaml.safe_load_all(text)) == [*docs, {"kind": "B"}]


def test_writes_are_whole_files_and_leave_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "m.yaml"
    write_atomic(target, "one\n")
    write_atomic(target, "two\n")
    assert target.read_text() == "two\n"
    assert [p.name for p in target.parent.iterdir()] == ["m.yaml"]


def test_reading_a_file_or_stdin(tmp_path: Path, monkeypatch) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("kind: A\n"))
    assert read_text("-") == "kind: A\n"
    with pytest.raises(RayhfError, match="no such file or directory"):
        read_text(str(tmp_path / "x.yaml"))
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RayhfError, match=r"cannot read it \(UnicodeDecodeError\)"):
        read_text(str(binary))
