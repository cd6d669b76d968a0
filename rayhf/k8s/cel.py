"""The small part of CEL that the KubeRay CRDs' ``x-kubernetes-validations`` rules use.

Supported: ``has(self.a.b)``, ``self.a``, string literals, lists of them, ``in``, ``==``, ``!=``,
``!``, ``&&``, ``||`` and parentheses. A rule that uses anything else, or that compares with
``oldSelf`` (a transition rule: only checked on update, and a manifest is a create), is not
evaluated: ``evaluate`` returns None for it.
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN_RE = re.compile(r"\s*(&&|\|\||==|!=|!|\(|\)|\[|\]|,|\.|'[^']*'|\"[^\"]*\"|[A-Za-z_]\w*)")
_MISSING = object()


class Unsupported(Exception):
    """The rule uses CEL this evaluator does not implement."""


def _tokenize(rule: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(rule.rstrip()):
        m = _TOKEN_RE.match(rule, pos)
        if m is None:
            raise Unsupported(rule[pos:])
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


def _truth(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Unsupported("a non-boolean used as a condition")
    return value


class _Parser:
    """Recursive descent over the tokens, evaluating as it goes (the rules are tiny)."""

    def __init__(self, tokens: list[str], self_value: Any) -> None:
        self.tokens, self.pos, self.self_value = tokens, 0, self_value

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise Unsupported(f"expected {expected!r}, got {token!r}")
        self.pos += 1
        return token

    def expr(self) -> Any:
        value = self.conjunction()
        while self.peek() == "||":
            self.take()
            right = self.conjunction()
            value = _truth(value) or _truth(right)
        return value

    def conjunction(self) -> Any:
        value = self.unary()
        while self.peek() == "&&":
            self.take()
            right = self.unary()
            value = _truth(value) and _truth(right)
        return value

    def unary(self) -> Any:
        if self.peek() == "!":
            self.take()
            return not _truth(self.unary())
        return self.comparison()

    def comparison(self) -> Any:
        left = self.operand()
        op = self.peek()
        if op not in ("==", "!=", "in"):
            return left
        self.take()
        right = self.operand()
        if left is _MISSING or right is _MISSING:
            raise Unsupported("comparison with a field that is not set")
        if op == "in":
            return left in right
        return (left == right) if op == "==" else (left != right)

    def operand(self) -> Any:
        token = self.take()
        if token == "(":
            value = self.expr()
            self.take(")")
            return value
        if token == "[":
            items = []
            while self.peek() != "]":
                items.append(self.operand())
                if self.peek() == ",":
                    self.take()
            self.take("]")
            return items
        if token[0] in "'\"":
            return token[1:-1]
        if token == "has":
            self.take("(")
            value = self.selector(self.take())
            self.take(")")
            return value is not _MISSING
        return self.selector(token)

    def selector(self, root: str) -> Any:
        if root != "self":
            raise Unsupported(root)  # oldSelf (transition rules) and functions
        value = self.self_value
        while self.peek() == ".":
            self.take()
            field = self.take()
            value = value.get(field, _MISSING) if isinstance(value, dict) else _MISSING
        return value


def evaluate(rule: str, self_value: Any) -> bool | None:
    """True/False for a supported rule, None for one this evaluator leaves to the API server."""
    try:
        parser = _Parser(_tokenize(rule), self_value)
        value = _truth(parser.expr())
        if parser.peek() is not None:
            raise Unsupported(parser.peek() or "")
    except Unsupported:
        return None
    return value
