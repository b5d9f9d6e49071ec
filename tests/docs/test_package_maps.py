"""Each sub-package's `__init__.py` docstring is a map of the package, checked against its files.

For every sub-package of `src/nonstop` (but `assets/`), the docstring names every module of the
package (`foo.py`, but `__init__.py`) and names no module the package does not hold. Only tokens
that look like `name.py` are checked; a path with a slash (`orchestrator/episodes.py`) points
elsewhere and is left alone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "nonstop"
SKIP = {"assets"}

# `name.py` not preceded by a path character (a slash or part of a longer name).
MODULE_TOKEN = re.compile(r"(?<![\w/.])(\w+\.py)\b")


def packages() -> list[Path]:
    return sorted(p for p in PACKAGE.iterdir() if (p / "__init__.py").exists() and p.name not in SKIP)


def named_modules(docstring: str) -> set[str]:
    return {m.group(1) for m in MODULE_TOKEN.finditer(docstring)}


@pytest.mark.parametrize("package", packages(), ids=lambda p: p.name)
def test_package_docstring_maps_every_module(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    named = named_modules(docstring)
    missing, stale = sorted(modules - named), sorted(named - modules - {"__init__.py"})
    assert not missing and not stale, (
        f"nonstop.{package.name}'s __init__.py docstring: missing {missing}, names modules it does not hold {stale}"
    )
