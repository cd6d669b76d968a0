"""A RayService's ``spec.serveConfigV2``, checked with Ray Serve's own schema.

``ray.serve.schema.ServeDeploySchema`` is what the Serve controller validates the config with,
so its verdict is the one that counts; it is imported on first use (Ray takes ~2 s to import).
Serve deliberately *ignores* keys it does not know (forward compatibility), which turns a typo
such as ``num_replica`` into a silently missing setting; this module reports those keys as
errors, walking the same pydantic models to know which keys exist.
"""

from __future__ import annotations

import types
import typing
from typing import Any

import yaml

_PATH = "spec.serveConfigV2"


def serve_config_errors(doc: dict[str, Any]) -> list[str]:
    """Errors in the Serve config of a RayService document (none for other kinds)."""
    text = (doc.get("spec") or {}).get("serveConfigV2") if doc.get("kind") == "RayService" else None
    if not isinstance(text, str):
        return []
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        return [f"{_PATH}: not valid YAML: {str(e).splitlines()[0]}"]
    if not isinstance(config, dict):
        return [f"{_PATH}: must be a YAML mapping with an 'applications' list"]
    from ray.serve.schema import ServeDeploySchema

    return _pydantic_errors(ServeDeploySchema, config) + unknown_keys(ServeDeploySchema, config, "")


def _format_loc(loc: tuple[Any, ...], data: Any) -> str:
    """``applications[0].deployments[0].num_replicas``; pydantic's union-member tags
    (``constrained-int``, ``str``...) are told apart by not being keys of the input."""
    out = ""
    for part in loc:
        if isinstance(data, list) and isinstance(part, int) and part < len(data):
            out, data = f"{out}[{part}]", data[part]
        elif isinstance(data, dict) and part in data:
            out, data = (f"{out}.{part}" if out else str(part)), data[part]
    return out or "(top level)"


def _pydantic_errors(model: Any, config: dict[str, Any]) -> list[str]:
    from pydantic import ValidationError

    try:
        model.model_validate(config)
    except ValidationError as e:
        messages: dict[str, list[str]] = {}
        for err in e.errors():
            if err["type"] != "extra_forbidden":  # reported by unknown_keys, once
                messages.setdefault(_format_loc(err["loc"], config), []).append(err["msg"])
        return [f"{_PATH}: {where}: {' or '.join(msgs)}" for where, msgs in messages.items()]
    return []


def _models_in(annotation: Any) -> tuple[Any, bool]:
    """(pydantic model, is-a-list-of-it) for ``Model``, ``Optional[Model]``, ``List[Model]``."""
    from pydantic import BaseModel

    def is_model(t: Any) -> bool:
        return isinstance(t, type) and issubclass(t, BaseModel)

    if is_model(annotation):
        return annotation, False
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is list and args and is_model(args[0]):
        return args[0], True
    real = [a for a in args if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and len(real) == 1:
        return _models_in(real[0])
    return None, False  # free-form (dict, Union with dict): any key is meant


def unknown_keys(model: Any, data: Any, path: str) -> list[str]:
    """Keys of ``data`` that ``model`` (recursively) has no field for."""
    if not isinstance(data, dict):
        return []
    fields = model.model_fields
    known = set(fields) | {f.alias for f in fields.values() if f.alias}
    errors = []
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in known:
            errors.append(f"{_PATH}: {where}: unknown key (Ray Serve would silently ignore it)")
            continue
        field = fields.get(key) or next(f for f in fields.values() if f.alias == key)
        sub, is_list = _models_in(field.annotation)
        if sub is None:
            continue
        if is_list and isinstance(value, list):
            for i, item in enumerate(value):
                errors += unknown_keys(sub, item, f"{where}[{i}]")
        elif not is_list:
            errors += unknown_keys(sub, value, where)
    return errors
