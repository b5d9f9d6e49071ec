"""The package's source read with `ast`, nothing of it imported: its modules and every import in them.

An import counts wherever it stands: at module level, inside a function (it still ties the two
modules together, only later) and under `if TYPE_CHECKING:` (mypy follows it; a circle there is a
circle of types). Relative imports are resolved, and `from pkg import mod` names the submodule when
`mod` is one. Used by the architecture tests in tests/docs/.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

from support import SRC_DIR

PACKAGE = SRC_DIR / "nonstop"


@dataclass(frozen=True, slots=True)
class Import:
    module: str
    """The importing module, dotted (`nonstop.orchestrator.fit`; a package is its `__init__`)."""
    path: Path
    line: int
    target: str
    """The module imported: `from a.b import c` is `a.b.c` when that is a module, else `a.b`."""
    names: tuple[str, ...]
    """The names a from-import takes from `target` (empty for `import a.b` and submodules)."""
    in_function: bool
    """Inside a function body (a method, a nested function), not at module or class level."""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parent)}:{self.line}"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of src/nonstop by its dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_in(source: str, module: str, path: Path, is_package: bool, known: set[str]) -> list[Import]:
    """Every import statement of `source` (the text of `module`), in the order they appear."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                out.extend(Import(module, path, child.lineno, a.name, (), in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    anchor = parts[: len(parts) - child.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                names = []
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:
                        out.append(Import(module, path, child.lineno, sub, (), in_function))
                    else:
                        names.append(a.name)
                if names:
                    out.append(Import(module, path, child.lineno, base, tuple(names), in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return out


def all_imports() -> list[Import]:
    """Every import of every module of src/nonstop."""
    mods = modules()
    known = set(mods)
    return [
        imp
        for name, path in mods.items()
        for imp in imports_in(path.read_text(), name, path, path.name == "__init__.py", known)
    ]


def ours(target: str) -> bool:
    return target == "nonstop" or target.startswith("nonstop.")
