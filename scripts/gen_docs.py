"""The generated pages of docs/: the decisions index and the configuration reference.

    python scripts/gen_docs.py           # write them
    python scripts/gen_docs.py --check   # exit 1 naming each page that is stale

``docs/decisions/README.md`` lists every record in ``docs/decisions/NNNN-slug.md`` by area, the
current ones first and the superseded ones apart. A record starts::

    # Title

    *Area: Generation · 2026-11-27 · current*

``docs/configuration.md`` is every field of the experiment config, from the pydantic models:
its type, default and docstring (``use_attribute_docstrings``) or comment-free description.
"""

from __future__ import annotations

import argparse
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
DECISIONS = REPO / "docs" / "decisions"
CONFIG_PAGE = REPO / "docs" / "configuration.md"
AREAS = (
    "Data, models and algorithms",
    "Sharded model and parallelism",
    "Runtime and driver",
    "Fault tolerance",
    "Reallocation",
    "Engines",
    "Generation",
    "Asynchronous RL",
    "GPUs",
    "Training stages and the pipeline example",
    "Planner",
    "Environments and tools",
)
_META = re.compile(r"^\*Area: (?P<area>[^·]+) · (?P<date>[^·]+) · (?P<status>.+)\*$")


def read_record(path: Path) -> dict[str, str]:
    """Title, area, date and status of one record; a malformed head names the file."""
    lines = path.read_text().splitlines()
    meta = _META.match(lines[2]) if len(lines) > 2 and lines[0].startswith("# ") else None
    if meta is None or meta["area"].strip() not in AREAS:
        raise SystemExit(f"{path}: start with '# Title', a blank line, '*Area: A · date · status*'")
    fields = {k: v.strip() for k, v in meta.groupdict().items()}
    return {"file": path.name, "title": lines[0][2:], **fields}


def decisions_index() -> str:
    records = [read_record(p) for p in sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md"))]
    current = [r for r in records if not r["status"].startswith("superseded")]
    lines = [
        "# Decisions",
        "",
        "Choices a newcomer would question, one record each: the decision, the measurement behind",
        "it and the alternative turned down. Each is dated (first written, plus the last revision)",
        "and shows its status today; superseded records stay for history and name what replaced",
        "them. This index is generated: `python scripts/gen_docs.py`.",
        "",
        f"## Current ({len(current)})",
    ]
    for area in AREAS:
        mine = [r for r in current if r["area"] == area]
        if mine:
            lines += ["", f"**{area}**", ""]
            lines += [f"- [{r['title']}]({r['file']}) ({r['status']})" for r in mine]
    superseded = [r for r in records if r["status"].startswith("superseded")]
    lines += ["", f"## Superseded ({len(superseded)})", ""]
    lines += [f"- [{r['title']}]({r['file']}) ({r['status']})" for r in superseded]
    return "\n".join(lines) + "\n"


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it in YAML terms."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return " or ".join(dict.fromkeys(_type_name(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return ", ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]
        return "(section defaults)" if isinstance(value, BaseModel) else f"`{value!r}`"
    if info.default is PydanticUndefined:
        return "required"
    return f"`{info.default!r}`"


KEYS = {"models": "<role>", "engines": "<call>", "plan": "<call>"}  # what a mapping's keys are


def _sections(model: type[BaseModel], prefix: str, out: list[str], seen: set[str]) -> None:
    """One table of ``model``'s fields under ``prefix``, then each nested section's."""
    rows, nested = [], []
    for name, info in model.model_fields.items():
        doc = " ".join((info.description or "").split()).replace("|", "\\|")
        kind = _type_name(info.annotation)
        rows.append(f"| `{prefix}{name}` | {kind} | {_default(info)} | {doc} |")
        for sub, container in _models_in(info.annotation):
            key = {"dict": f".{KEYS.get(name, '<key>')}", "list": "[]"}.get(container, "")
            nested.append((f"{prefix}{name}{key}.", sub))
    title = prefix.rstrip(".") or "top level"
    out += ["", f"## `{title}` ({model.__name__})", ""]
    if model.__doc__:
        out += [" ".join(model.__doc__.split()), ""]
    out += ["| field | type | default | meaning |", "| --- | --- | --- | --- |", *rows]
    for sub_prefix, sub in nested:
        key = f"{sub_prefix}{sub.__name__}"
        if key not in seen:
            seen.add(key)
            _sections(sub, sub_prefix, out, seen)


def _models_in(annotation: Any, container: str = "") -> list[tuple[type[BaseModel], str]]:
    """The config sections a field holds, each with what holds it: "" (the field itself or a
    union), "dict" (mapping values) or "list" (items)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, container)]
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is dict:
        args, container = args[1:], "dict"
    elif origin in (list, tuple):
        container = "list"
    found: list[tuple[type[BaseModel], str]] = []
    for arg in args:
        found += [m for m in _models_in(arg, container) if m not in found]
    return found


def config_reference() -> str:
    from rayhf.config.experiment import ExperimentConfig

    out = [
        "# Configuration reference",
        "",
        "Every field of an experiment config (`rayhf run CONFIG`), generated from the pydantic",
        "models by `python scripts/gen_docs.py`; a test fails when this page is stale.",
        "`rayhf config show CONFIG` prints a config with every default filled in, `rayhf config",
        "schema` its JSON schema. A `models.<role>` entry is a `RoleConfig`, an `engines.<call>`",
        "entry one of the engine sections, chosen by `engine`; `algorithm` is one of the",
        "algorithm sections, chosen by `name`.",
    ]
    _sections(ExperimentConfig, "", out, set())
    return "\n".join(out) + "\n"


PAGES = {DECISIONS / "README.md": decisions_index, CONFIG_PAGE: config_reference}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = ap.parse_args()
    stale = []
    for path, make in PAGES.items():
        text = make()
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path.relative_to(REPO)))
        else:
            path.write_text(text)
    if stale:
        sys.exit(f"stale: {', '.join(stale)}; run python scripts/gen_docs.py")


if __name__ == "__main__":
    main()
