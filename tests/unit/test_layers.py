"""The package's layers, bottom to top (the table of docs/architecture.md): a module imports
only from its own layer and the layers below it, and the planner and graph import no execution
code. Every import in every module counts, at the top or inside a function."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# bottom first; names in one tuple share a layer
LAYERS: list[tuple[str, ...]] = [
    ("errors", "startup"),
    ("metrics",),
    ("graph",),
    ("models",),
    ("data", "sampling"),
    ("parallel",),
    ("engines",),
    ("algorithms", "rewards"),
    ("envs",),
    ("tasks",),
    ("realloc",),
    ("planner",),
    ("config",),
    ("runtime",),
    ("serve",),
    ("k8s",),
    ("checks",),
    ("cli",),
]
TOP_LEVEL = {"__init__", "__main__"}  # the package's facade may import any layer
# The planner decides from numbers and the graph is data: neither runs anything. What of the
# lower layers they may use is their pure vocabulary.
PURE = {"planner", "graph"}
PURE_ALLOWED = (
    "rayhf.parallel.layout",
    "rayhf.parallel.buckets",
    "rayhf.engines.config",
    "rayhf.realloc.plan",
)
EXECUTION = ("ray", "torch.distributed", "rayhf.engines", "rayhf.parallel", "rayhf.realloc",
             "rayhf.runtime")  # fmt: skip


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer(package: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if package in names)


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            out.append((node.lineno, module))
    return out


def violations(root: Path) -> list[str]:
    """Every import under ``root/rayhf`` that breaks the layering, as ``file:line -> module``."""
    found = []
    for path in sorted((root / "rayhf").rglob("*.py")):
        mine = path.relative_to(root / "rayhf").with_suffix("").parts[0]
        if mine in TOP_LEVEL:
            continue
        for line, module in _imports(path, root):
            where = f"{path.relative_to(root)}:{line} -> {module}"
            other = module.split(".")
            package = other[1] if other[0] == "rayhf" and len(other) > 1 else None
            if package is not None and package not in TOP_LEVEL and _layer(package) > _layer(mine):
                found.append(f"{where} (upward)")
            elif mine in PURE and _under(module, EXECUTION):
                allowed = _under(module, (*PURE_ALLOWED, f"rayhf.{mine}"))
                if not allowed:
                    found.append(f"{where} (execution code in {mine})")
    return found


def test_every_package_has_a_layer():
    code = [
        p for p in (REPO / "rayhf").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    ]
    packages = {p.with_suffix("").name for p in code} - TOP_LEVEL
    placed = {name for names in LAYERS for name in names}
    assert packages <= placed, f"give these a layer: {sorted(packages - placed)}"


def test_no_import_runs_upward_and_the_planner_runs_nothing():
    assert violations(REPO) == []


def test_a_planted_upward_import_is_caught(tmp_path):
    shutil.copytree(REPO / "rayhf", tmp_path / "rayhf", ignore=shutil.ignore_patterns("*.pyc"))
    spec = tmp_path / "rayhf" / "models" / "spec.py"
    spec.write_text(spec.read_text() + "\n\ndef _late():\n    from rayhf.runtime import trainer\n")
    planner = tmp_path / "rayhf" / "planner" / "cost.py"
    planner.write_text(planner.read_text() + "\nimport ray\n")
    found = violations(tmp_path)
    assert any("models/spec.py" in v and "rayhf.runtime" in v and "upward" in v for v in found)
    assert any("planner/cost.py" in v and "-> ray (execution" in v for v in found)
    assert len(found) == 2


def _graph_names() -> set[str]:
    """Every role and batch key the shipped graphs name."""
    import yaml

    names: set[str] = set()
    for path in (REPO / "graphs").glob("*.yaml"):
        graph = yaml.safe_load(path.read_text())
        names.update(graph["inputs"])
        for call in graph["calls"]:
            names.add(call["role"])
            names.update(call.get("inputs", []) + call.get("outputs", []))
            names.update(call.get("input_remap", {}))
            names.update(call.get("output_remap", {}))
    return names


def test_the_runtime_names_no_role_and_no_batch_key():
    """What the runtime knows of roles and keys comes from the graph and the interfaces: no
    string in ``rayhf/runtime`` is a role or key of a shipped graph."""
    names = _graph_names()
    assert {"actor", "critic", "ref", "reward", "seq", "prompts", "chosen"} <= names
    found = []
    for path in sorted((REPO / "rayhf" / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
    assert found == []
