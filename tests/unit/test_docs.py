"""The generated pages of docs/ are current: the decisions index lists every record (the
superseded ones apart) and the configuration reference documents every config field."""

from __future__ import annotations

import ast
import importlib.util
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
assert _spec is not None and _spec.loader is not None
gen_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_docs)


def test_the_generated_pages_are_current():
    for path, make in gen_docs.PAGES.items():
        assert path.read_text() == make(), f"{path} is stale: run python scripts/gen_docs.py"


def test_the_index_lists_every_record_once_and_superseded_ones_apart():
    records = sorted(p.name for p in gen_docs.DECISIONS.glob("[0-9]*.md"))
    numbers = [name[:4] for name in records]
    assert len(set(numbers)) == len(numbers) >= 70, "one number per record"
    index = (gen_docs.DECISIONS / "README.md").read_text()
    current, superseded = index.split("## Superseded")
    linked = re.findall(r"\]\((\d{4}-[^)]+\.md)\)", index)
    assert sorted(linked) == records
    for name in re.findall(r"\]\((\d{4}-[^)]+\.md)\)", superseded):
        assert gen_docs.read_record(gen_docs.DECISIONS / name)["status"].startswith("superseded")
    for name in re.findall(r"\]\((\d{4}-[^)]+\.md)\)", current):
        assert not gen_docs.read_record(gen_docs.DECISIONS / name)["status"].startswith("supers")


def test_every_config_field_is_documented():
    page = gen_docs.config_reference()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    undocumented = [row.split("|")[1].strip() for row in rows if row.rstrip().endswith("|  |")]
    assert undocumented == [], f"give these fields a docstring: {undocumented}"
    assert "| `models.<role>.optimizer.lr` | float | `0.0001` |" in page


def _links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text()) if "://" not in t]


def test_every_link_of_the_readme_and_the_user_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert len(pages) >= 13
    broken = [
        f"{page.relative_to(REPO)} -> {target}"
        for page in pages
        for target in _links(page)
        if not (page.parent / target.split("#")[0]).exists()
    ]
    assert broken == []


def test_the_readme_is_a_landing_page_whose_figures_link_to_their_pages():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h)]
    assert hashes == [], "commits belong on the benchmark pages"
    results = text.split("## Results")[1].split("\n## ")[0]
    rows = [line for line in results.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) > 5 and all("](docs/" in row for row in rows[1:])


def test_role_config_documents_ema_and_function_each_as_itself():
    from rayhf.config.experiment import RoleConfig

    ema = RoleConfig.model_fields["ema"].description or ""
    function = RoleConfig.model_fields["function"].description or ""
    assert "ema * source + (1 - ema) * w" in ema and "module:function" not in ema
    assert "module:function" in function and "reward" in function and "ema" not in function


# What a comment or docstring cites: a file or folder of the repository (a path under one of
# its top-level folders, with a suffix or a trailing slash, or a glob), or a module or name
# as Python would import it (``rayhf.parallel.decode``, ``rayhf.planner.hardware.CPU_*``).
CITED_PATH = re.compile(
    r"(?<![\w./-])((?:rayhf|docs|benchmarks|examples|tests|scripts|graphs|k8s|deployments)/[\w./*-]*)"
)
CITED_MODULE = re.compile(r"(?<![\w./-])rayhf((?:\.\w+)+\*?)")
SUFFIXES = {".py", ".md", ".yaml", ".json", ".sh", ".toml", ".png", ".txt"}


def _prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every string statement (docstrings) of a module."""
    source = path.read_text()
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    found = [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        value = node.value if isinstance(node, ast.Expr) else None
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            found.append((node.lineno, value.value))
    return found


def _path_exists(cited: str) -> bool:
    cited = cited.rstrip(".")
    if "*" in cited:
        return any(REPO.glob(cited))
    if not (cited.endswith("/") or Path(cited).suffix in SUFFIXES):
        return True  # not plainly a path (an image name, a module without .py): not checked
    return (REPO / cited).exists()


def _module_exists(dotted: str) -> bool:
    """``rayhf.a.b.name`` as Python resolves it: packages, then a module, then a name in it; a
    name after a package is one its ``__init__`` has (``name*``: a name that starts so)."""
    here = REPO / "rayhf"
    parts = dotted.strip(".").split(".")
    for i, part in enumerate(parts):
        if (here / part).is_dir():
            here = here / part
        elif (here / f"{part}.py").exists():
            return i + 1 == len(parts) or _has_name(here / f"{part}.py", parts[i + 1])
        else:
            return _has_name(here / "__init__.py", part)
    return True


def _has_name(module: Path, name: str) -> bool:
    stem = name.rstrip("*") + ("" if name.endswith("*") else r"\b")
    return module.exists() and re.search(rf"\b{stem}", module.read_text()) is not None


def stale_citations(folders: tuple[str, ...]) -> list[str]:
    found = []
    for path in (p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))):
        for line, text in _prose(path):
            where = f"{path.relative_to(REPO)}:{line}"
            found += [
                f"{where} {m[1]}" for m in CITED_PATH.finditer(text) if not _path_exists(m[1])
            ]
            found += [
                f"{where} rayhf{m[1]}"
                for m in CITED_MODULE.finditer(text)
                if not _module_exists(m[1])
            ]
    return found


def test_every_file_and_module_the_code_and_tests_cite_exists():
    assert stale_citations(("rayhf", "tests", "benchmarks", "examples")) == []
    assert _module_exists(".parallel.decode") and _module_exists(".planner.hardware.CPU_*")
    assert not _module_exists(".parallel.generate"), "a module that is gone"
    assert not _module_exists(".realloc.mover.WeightMover"), "a name that is gone"
    assert _path_exists("docs/decisions/0086-*") and not _path_exists("docs/gone.md")


def test_the_architecture_page_lists_the_layers_the_layer_test_holds():
    spec = importlib.util.spec_from_file_location("test_layers", REPO / "tests/unit/test_layers.py")
    assert spec is not None and spec.loader is not None
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    page = (REPO / "docs" / "architecture.md").read_text()
    table = page.split("| layer (bottom first) | what |")[1].split("\n\n")[0]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    assert [tuple(re.findall(r"`(\w+)`", row)) for row in rows] == layers.LAYERS
