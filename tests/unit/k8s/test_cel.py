"""The CEL subset of the KubeRay CRDs' validation rules (``rayhf.k8s.cel``)."""

from __future__ import annotations

import pytest
from k8s_support import K8S_MARKS
from k8s_support import crds as crds

from rayhf.k8s import CRDSet
from rayhf.k8s.cel import evaluate

pytestmark = K8S_MARKS


def test_every_crd_rule_is_evaluated_or_is_a_transition_rule(crds: CRDSet) -> None:
    rules: list[str] = []

    def walk(schema: dict) -> None:
        rules.extend(r["rule"] for r in schema.get("x-kubernetes-validations", ()))
        for child in [*schema.get("properties", {}).values(), schema.get("items")]:
            if isinstance(child, dict):
                walk(child)

    for schema in crds.schemas.values():
        walk(schema)
    assert len(rules) > 10
    for rule in rules:
        assert ("oldSelf" in rule) == (evaluate(rule, {"a": 1}) is None), rule
    both = "((has(self.onSuccess) && has(self.onFailure)) || has(self.deletionRules))"
    assert evaluate(both, {"onSuccess": {}, "onFailure": {}}) is True
    assert evaluate(both, {"onSuccess": {}}) is False
    assert evaluate("self in ['a', 'b']", "b") is True and evaluate("self in ['a']", "c") is False


@pytest.mark.parametrize(
    "rule,value,expected",
    [
        ("has(self.a)", {"a": 1}, True),
        ("has(self.a.b)", {"a": {}}, False),
        ("!has(self.a) || self.a == 'x'", {"a": "x"}, True),
        ("!has(self.a) || self.a == 'x'", {"a": "y"}, False),
        ("self.mode in ['A', \"B\"]", {"mode": "B"}, True),
        ("(self == 'a' || self == 'b') && self != 'b'", "a", True),
        # left to the API server: a comparison with an unset field, functions and other
        # operators, a non-boolean result, transition rules, a broken rule
        ("self.a == 'x'", {}, None),
        ("self.size() > 1", [1, 2], None),
        ("self.a", {"a": 1}, None),
        ("self == oldSelf", 1, None),
        ("has(self.a) &&", {"a": 1}, None),
    ],
)
def test_the_supported_subset_and_what_is_left_out(rule: str, value, expected) -> None:
    assert evaluate(rule, value) is expected
