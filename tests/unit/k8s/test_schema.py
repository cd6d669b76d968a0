"""CRD schema validation (``rayhf.k8s.schema``): normalizing like the API server, then types,
bounds, formats and list types, each error with its field path."""

from __future__ import annotations

import pytest
from k8s_support import K8S_MARKS, _errors, _worker
from k8s_support import crds as crds
from k8s_support import job as job
from k8s_support import rendered as rendered

from rayhf.k8s import CRDSet
from rayhf.k8s.schema import normalize, validate_object

pytestmark = K8S_MARKS


def test_nulls_and_defaults_behave_like_the_api_server(job: dict, crds: CRDSet) -> None:
    del _worker(job)["minReplicas"]  # required, but defaulted to 0 first
    _worker(job)["maxReplicas"] = None  # dropped, then defaulted to 2147483647
    job["spec"]["backoffLimit"] = None
    assert _errors(job, crds) == []


SCHEMA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 5, "pattern": "^[a-z]+$"},
        "mode": {"type": "string", "enum": ["A", "B"], "default": "A"},
        "count": {"type": "integer", "format": "int32", "minimum": 0},
        "port": {"x-kubernetes-int-or-string": True},
        "when": {"type": "string", "format": "date-time"},
        "tags": {
            "type": "array",
            "items": {"type": "string"},
            "maxItems": 3,
            "x-kubernetes-list-type": "set",
        },
        "ports": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["port", "protocol"],
            "items": {
                "type": "object",
                "properties": {
                    "port": {"type": "integer"},
                    "protocol": {"type": "string", "default": "TCP"},
                },
            },
        },
        "limits": {
            "type": "object",
            "properties": {"low": {"type": "integer"}, "high": {"type": "integer"}},
            "x-kubernetes-validations": [
                {"rule": "has(self.low) == has(self.high)", "message": "set both or neither"}
            ],
        },
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
        "note": {"type": "string", "nullable": True},
        "opt": {"type": "string"},
    },
}


def test_normalizing_fills_defaults_and_drops_nulls_then_a_valid_object_passes() -> None:
    value = {
        "name": "ab",
        "count": 2.0,  # a JSON integer to the API server
        "port": "http",
        "when": "2024-01-01T00:00:00Z",
        "tags": ["a", "b"],
        "ports": [{"port": 80}, {"port": 80, "protocol": "UDP"}],
        "limits": {"low": 1, "high": 2},
        "env": {"A": "1"},
        "free": {"x": {"y": 1}},
        "note": None,
        "opt": None,
    }
    normalized = normalize(value, SCHEMA)
    assert normalized["mode"] == "A" and normalized["ports"][0]["protocol"] == "TCP"
    assert "opt" not in normalized and normalized["note"] is None
    assert "mode" not in value, "the input is left alone"
    assert validate_object(normalized, SCHEMA) == []


@pytest.mark.parametrize(
    "value,error",
    [
        ({}, "name: required field is missing"),
        ({"name": "abcdef"}, "name: must have at most 5 characters, has 6"),
        ({"name": "AB"}, "name: 'AB' does not match the pattern ^[a-z]+$"),
        ({"mode": "C"}, 'mode: unsupported value string \'C\'; supported values: "A", "B"'),
        ({"count": -1}, "count: must be greater than or equal to 0, got -1"),
        ({"count": 2**31}, "count: 2147483648 is out of the int32 range"),
        ({"count": 1.5}, "count: must be an integer, got number 1.5"),
        ({"count": True}, "count: must be an integer, got boolean true"),
        ({"port": [1]}, "port: must be an integer or a string, got a list"),
        ({"when": "2024-01-01"}, "when: '2024-01-01' is not an RFC 3339 date-time"),
        ({"tags": ["a", "a"]}, "tags[1]: duplicate value string 'a' in a set"),
        ({"tags": ["a", "b", "c", "d"]}, "tags: must have at most 3 items, has 4"),
        ({"tags": [None]}, "tags[0]: must not be null (give a value or remove the field)"),
        (
            {"ports": [{"port": 80}, {"port": 80, "protocol": "TCP"}]},
            'ports[1]: duplicate entry for list-map keys port=80, protocol="TCP"',
        ),
        ({"limits": {"low": 1}}, "limits: set both or neither"),
        ({"env": {"A": 1}}, "env[A]: must be a string, got integer 1"),
        ({"extra": 1}, "extra: unknown field 'extra'"),
    ],
)
def test_each_violation_is_one_error_with_its_path(value: dict, error: str) -> None:
    value = {"name": "a", **value} if value else value
    assert validate_object(normalize(value, SCHEMA), SCHEMA) == [error]
