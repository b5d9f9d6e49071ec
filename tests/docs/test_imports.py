"""Two rules for every module of src/nonstop, read from the source with `ast` (nothing imported):

- no module takes another module's underscore names, by a from-import or as an attribute of a
  module it imported: a name another module needs is public (its module's own business otherwise);
- an import inside a function says why it is not at the top of the module, in a comment on its
  line or just above it (a run of imports shares one comment above the first), starting with one
  of the reasons below; and there are at most LAZY_IMPORTS of them.

A function-level import hides an edge of the import graph until the call, so it is kept only for:
- `optional:` an optional dependency (an extra such as vllm, peft, ray, matplotlib);
- `spawn:` code that runs in another process (an actor), loaded there;
- `start-up:` a module the command line (or `import nonstop`) loads before it knows the command,
  keeping torch out until a command needs it (`nonstop --help`, `config`, `verify` start light);
- `cycle:` two modules of one package that need each other (the layer order forbids any other).
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

from support.source import PACKAGE, modules

REASON = re.compile(r"#\s*(optional|spawn|start-up|cycle):")

LAZY_IMPORTS = 40
"""Function-level imports in src/nonstop at most (issue 53's bar): each one an optional extra, a
spawned process's own load, the command line's light start, or a cycle within a package."""


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(source: str, module: str, known: set[str]) -> list[tuple[int, str, str]]:
    """(line, module, name) for each underscore name `source` takes from another module of ours:
    from-imported, or read as an attribute of a module of ours it imported."""
    is_package = module in known and any(k.startswith(module + ".") for k in known)
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> module of ours it stands for
    found: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            if not (base == "nonstop" or base.startswith("nonstop.")):
                continue
            for a in node.names:
                if f"{base}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{base}.{a.name}"
                elif private(a.name) and base != module:
                    found.append((node.lineno, base, a.name))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in known:
                    bound[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and private(node.attr):
            target = bound.get(node.value.id)
            if target is not None and target != module:
                found.append((node.lineno, target, node.attr))
    return sorted(set(found))


def test_no_module_takes_another_modules_underscore_names() -> None:
    mods = modules()
    known = set(mods)
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line} takes {target}.{attr}"
        for name, path in mods.items()
        for line, target, attr in private_uses(path.read_text(), name, known)
    ]
    assert not bad, "underscore names taken across modules (make them public, or move them):\n" + "\n".join(bad)


def comments(source: str) -> dict[int, str]:
    """Each line's comment, by line number."""
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string
    return out


def lazy_imports(source: str) -> list[tuple[int, bool]]:
    """(line, says why) of each import statement inside a function of `source`. Its reason is a
    comment on one of its lines, or among the comments above it, going up over blank lines, comment
    lines and other imports to the first line of code (whose own comment counts too)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    notes = comments(source)
    import_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            import_lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    found: list[tuple[int, bool]] = []

    def says_why(node: ast.Import | ast.ImportFrom) -> bool:
        own = range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if any(REASON.match(notes.get(n, "")) for n in own):
            return True
        n = node.lineno - 1
        while n >= 1:
            text = lines[n - 1].strip()
            if REASON.match(notes.get(n, "")):
                return True
            if text and not text.startswith("#") and n not in import_lines:
                return False  # the first line of code above, its own comment checked
            n -= 1
        return False

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child.lineno, says_why(child)))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def test_function_level_imports_say_why_and_stay_few() -> None:
    total, bad = 0, []
    for path in modules().values():
        for line, ok in lazy_imports(path.read_text()):
            total += 1
            if not ok:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    assert not bad, (
        "function-level imports without a reason (a comment starting 'optional:', 'spawn:', 'start-up:' or "
        "'cycle:'; or move the import to the top of the module):\n" + "\n".join(bad)
    )
    assert total <= LAZY_IMPORTS, f"{total} function-level imports in src/nonstop, more than {LAZY_IMPORTS}"


def test_the_checks_can_fail() -> None:
    """A private from-import, a private attribute of an imported module, a bare function-level
    import and an untagged comment are found; a tagged comment above a run of imports, or on the
    line of `try:`, covers them."""
    known = {"nonstop.a", "nonstop.b", "nonstop.pkg", "nonstop.pkg.c"}
    src = "from nonstop.b import _x, y\nfrom nonstop.pkg import c\nimport nonstop.b as bb\nc._z\nbb._w\nc.ok\n"
    assert private_uses(src, "nonstop.a", known) == [
        (1, "nonstop.b", "_x"),
        (4, "nonstop.pkg.c", "_z"),
        (5, "nonstop.b", "_w"),
    ]
    src = (
        "def f():\n    import os\n"
        "def g():\n    # just because\n    import os\n"
        "def h():\n    # start-up: torch only here\n    import torch\n\n    from x import y\n"
        "def i():\n    try:  # optional: the extra\n        import z\n    except ImportError:\n        pass\n"
        "def j():\n    x = 1  # spawn: note on code above\n    import w  # noqa: F401\n"
    )
    assert lazy_imports(src) == [(2, False), (5, False), (8, True), (10, True), (13, True), (18, True)]
    assert lazy_imports(Path(__file__).read_text()) == []
