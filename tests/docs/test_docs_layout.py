"""docs/architecture.md's layout table is checked against the package tree, so it cannot drift.

The table's first column names every root module and sub-package of `src/nonstop` (and nothing
else); every module its second column names (`launch.py` in the `orchestrator/` row, or a path
such as `observe/spans.py`) exists.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nonstop"
DOC = ROOT / "docs" / "architecture.md"


def layout_rows() -> list[tuple[list[str], str]]:
    """(names in the first column, text of the second column) of each row of the Layout table."""
    text = DOC.read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, second = line.split("|")[1:3]
        rows.append((re.findall(r"`([^`]+)`", first), second))
    return rows


def tree() -> set[str]:
    """The root modules (but __init__.py) and the sub-packages (`name/`) of src/nonstop."""
    modules = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    packages = {p.name + "/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    return modules | packages


def test_layout_table_names_every_root_module_and_package_once() -> None:
    named = [name for names, _ in layout_rows() for name in names]
    assert len(named) == len(set(named)), f"named twice in docs/architecture.md's layout: {named}"
    missing, stale = tree() - set(named), set(named) - tree()
    assert not missing, f"docs/architecture.md's layout table does not name {sorted(missing)}"
    assert not stale, f"docs/architecture.md's layout table names {sorted(stale)}, which src/nonstop does not hold"


def test_layout_table_names_only_modules_that_exist() -> None:
    for names, text in layout_rows():
        base = [PACKAGE / n for n in names if n.endswith("/")]
        for ref in re.findall(r"`([\w/]+\.py)`", text):
            places = [PACKAGE / ref] + [b / ref for b in base]
            assert any(p.exists() for p in places), f"docs/architecture.md's layout row {names} names {ref}, not found"


def test_root_holds_at_most_thirteen_modules() -> None:
    """__init__.py and twelve: the error root (`errors.py`) sits below every package, so at the root."""
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 13, f"src/nonstop holds {len(modules)} modules: {modules}"
