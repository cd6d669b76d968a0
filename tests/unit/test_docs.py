"""The generated pages of docs/ are current: the decisions index lists every record (the
superseded ones apart) and the configuration reference documents every config field."""

from __future__ import annotations

import importlib.util
import re
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
