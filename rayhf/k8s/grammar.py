"""Kubernetes value grammars: resource quantities, object names, label keys and values.

Each is the rule of ``k8s.io/apimachinery`` (``resource.ParseQuantity``,
``validation.IsDNS1123Subdomain`` / ``IsDNS1035Label`` / ``IsQualifiedName`` /
``IsValidLabelValue``), written as regular expressions so a manifest can be checked offline.
"""

from __future__ import annotations

import re
from decimal import Decimal

# The CRDs' own quantity pattern also admits a fractional exponent ("1e2.5"), which
# resource.ParseQuantity then refuses when the operator decodes the object: accept only what both
# accept.
QUANTITY_RE = re.compile(
    r"^(?P<num>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
)
# The pattern controller-gen writes for every resource.Quantity field: it marks quantity fields.
CRD_QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
QUANTITY_HINT = "a Kubernetes quantity such as 500m, 2Gi, 1e3 or 4"

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL_RE = re.compile(f"^{_DNS1123_LABEL}$")
DNS1123_SUBDOMAIN_RE = re.compile(rf"^{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*$")
DNS1035_LABEL_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME_RE = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE_RE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def parse_quantity(value: object) -> Decimal | None:
    """The quantity's value (``"500m"`` -> 0.5), or None when it is not a valid quantity."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return Decimal(value)
    if not isinstance(value, str):
        return None
    m = QUANTITY_RE.match(value)
    if m is None:
        return None
    number, suffix = Decimal(m["num"]), m["suffix"] or ""
    if suffix in _BINARY:
        return number * (Decimal(1024) ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:]))


def dns1123_subdomain_error(name: str) -> str | None:
    """Why ``name`` is not a valid object name (DNS-1123 subdomain), or None."""
    if len(name) > 253:
        return "must be no more than 253 characters"
    if not DNS1123_SUBDOMAIN_RE.match(name):
        return (
            "must consist of lower case alphanumeric characters, '-' or '.', and must start "
            "and end with an alphanumeric character"
        )
    return None


def dns1123_label_error(name: str) -> str | None:
    """Why ``name`` is not a DNS-1123 label (namespaces, container names), or None."""
    if len(name) > 63:
        return "must be no more than 63 characters"
    if not DNS1123_LABEL_RE.match(name):
        return (
            "must consist of lower case alphanumeric characters or '-', and must start and "
            "end with an alphanumeric character"
        )
    return None


def dns1035_label_error(name: str, max_len: int = 63) -> str | None:
    """Why ``name`` is not a DNS-1035 label (what Services need, so what KubeRay wants)."""
    if len(name) > max_len:
        return f"must be no more than {max_len} characters"
    if not DNS1035_LABEL_RE.match(name):
        return (
            "must consist of lower case alphanumeric characters or '-', start with a letter "
            "and end with an alphanumeric character"
        )
    return None


def qualified_name_error(key: str) -> str | None:
    """Why ``key`` is not a valid label or annotation key (``[prefix/]name``), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or dns1123_subdomain_error(prefix)):
        return "prefix must be a DNS-1123 subdomain (e.g. example.com)"
    if not name or len(name) > 63:
        return "name part must be 1 to 63 characters"
    if not _QUALIFIED_NAME_RE.match(name):
        return (
            "name part must consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character"
        )
    return None


def label_value_error(value: str) -> str | None:
    """Why ``value`` is not a valid label value, or None."""
    if len(value) > 63:
        return "must be no more than 63 characters"
    if not _LABEL_VALUE_RE.match(value):
        return (
            "must be empty or consist of alphanumeric characters, '-', '_' or '.', and must "
            "start and end with an alphanumeric character"
        )
    return None
