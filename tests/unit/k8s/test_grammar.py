"""Kubernetes value grammars (``rayhf.k8s.grammar``): quantities, names, label keys and values."""

from __future__ import annotations

import pytest

from rayhf.k8s.grammar import (
    dns1035_label_error,
    dns1123_label_error,
    dns1123_subdomain_error,
    label_value_error,
    parse_quantity,
    qualified_name_error,
)


def test_quantity_grammar() -> None:
    assert parse_quantity("500m") == parse_quantity("0.5") == parse_quantity(".5")
    assert parse_quantity("2Gi") == 2 * 1024**3 and parse_quantity("1e3") == 1000 == parse_quantity(
        1000
    )
    assert parse_quantity("1E-3") == parse_quantity("1m") and parse_quantity("+4") == 4
    for bad in ("2GB", "1e2.5", "", "1.2.3", "Gi", "1 Gi", 0.5, True, None):
        assert parse_quantity(bad) is None, bad


def test_object_names() -> None:
    assert dns1123_subdomain_error("ppo-tiny.v1") is None
    assert "lower case" in (dns1123_subdomain_error("PPO") or "")
    assert dns1123_subdomain_error("a" * 254) == "must be no more than 253 characters"
    assert dns1123_label_error("a-b") is None and dns1123_label_error("a.b") is not None
    assert dns1123_label_error("a" * 64) == "must be no more than 63 characters"
    assert dns1035_label_error("up7") is None and dns1035_label_error("7up") is not None
    assert dns1035_label_error("abc", max_len=2) == "must be no more than 2 characters"


@pytest.mark.parametrize(
    "key,why",
    [
        ("app", None),
        ("example.com/app_name.v1", None),
        ("/app", "prefix must be a DNS-1123 subdomain (e.g. example.com)"),
        ("Example.com/app", "prefix must be a DNS-1123 subdomain (e.g. example.com)"),
        ("a/", "name part must be 1 to 63 characters"),
        ("x" * 64, "name part must be 1 to 63 characters"),
        ("-app", "name part must consist of alphanumeric characters, '-', '_' or '.', and "
                 "must start and end with an alphanumeric character"),
    ],
)  # fmt: skip
def test_label_keys(key: str, why: str | None) -> None:
    assert qualified_name_error(key) == why


def test_label_values() -> None:
    assert label_value_error("") is None and label_value_error("v1.2_x") is None
    assert label_value_error("-v") is not None and label_value_error("v ") is not None
    assert label_value_error("v" * 64) == "must be no more than 63 characters"
