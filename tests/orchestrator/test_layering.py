"""The package's layering, read from the source with `ast` (no module is imported).

Every import counts: at module level, inside functions (an import there still ties the two
modules together, it only hides it until the call) and under `if TYPE_CHECKING:` (mypy follows
it; a circle there is a circle of types). Checked:
- the orchestrator's modules import each other without a circle, so each can be read (and
  tested) after the ones it builds on, in the order its package docstring lists them;
- no lower layer (engine, trainer, transport, scoring, envs, tasks) imports the orchestrator:
  they are the parts the orchestrator wires together, usable without it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nonstop

SRC = Path(nonstop.__file__).parent
ORCHESTRATOR = "nonstop.orchestrator"
LOWER = ("engine", "trainer", "transport", "scoring", "envs", "tasks")


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports(source: str, package: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) for every import in `source` (a module of `package`), anywhere in it,
    relative ones resolved; `from pkg import mod` names the submodule when `mod` is one."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else base))
    return sorted(set(out))


def graph() -> tuple[dict[str, set[str]], dict[str, list[tuple[int, str]]]]:
    mods = modules()
    known = set(mods)
    edges = {
        name: imports(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0], known)
        for name, path in mods.items()
    }
    return {n: {m for _, m in e if m in known and m != n} for n, e in edges.items()}, edges


def cycles(nodes: set[str], deps: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as its members,
    sorted (a circle runs through all of them)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(deps[v] & nodes):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def circle(scc: list[str], deps: dict[str, set[str]]) -> list[str]:
    """One circle through the component's first module, found by breadth-first search."""
    members, start = set(scc), scc[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(deps[v] & members):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    return scc


def test_orchestrator_has_no_import_circle() -> None:
    deps, _ = graph()
    own = {n for n in deps if n.startswith(ORCHESTRATOR + ".")}
    assert len(own) > 5  # the walk found the orchestrator's modules
    found = cycles(own, deps)
    assert not found, "import circles in the orchestrator:\n" + "\n".join(
        f"among {', '.join(c)}: " + " -> ".join(circle(c, deps)) for c in found
    )


def test_the_orchestrator_docstring_lists_its_modules_in_import_order() -> None:
    """orchestrator/__init__.py names every module once, each after every module it imports: a
    reader can go down the list and meet nothing not yet read."""
    deps, _ = graph()
    doc = ast.get_docstring(ast.parse((SRC / "orchestrator" / "__init__.py").read_text())) or ""
    listed = [f"{ORCHESTRATOR}.{m}" for m in re.findall(r"^- (\w+)\.py", doc, re.MULTILINE)]
    assert sorted(listed) == sorted(n for n in deps if n.startswith(ORCHESTRATOR + ".")), listed
    late = [
        f"{m} imports {d}, listed after it" for i, m in enumerate(listed) for d in sorted(deps[m] & set(listed[i:]))
    ]
    assert not late, "\n".join(late)


def test_lower_layers_do_not_import_the_orchestrator() -> None:
    _, edges = graph()
    lower = [n for n in edges if any(n.startswith(f"nonstop.{p}.") or n == f"nonstop.{p}" for p in LOWER)]
    assert len(lower) > 20
    bad = [
        f"{modules()[n].relative_to(SRC.parent)}:{line} imports {m}"
        for n in lower
        for line, m in edges[n]
        if m == ORCHESTRATOR or m.startswith(ORCHESTRATOR + ".")
    ]
    assert not bad, "lower layers import the orchestrator:\n" + "\n".join(bad)


def test_the_walk_sees_hidden_and_relative_imports_and_finds_circles() -> None:
    """Function-level, TYPE_CHECKING and relative imports are edges too (the checks above would be
    blind without them), and a circle is found and shown whatever module it is entered from."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from nonstop.orchestrator.build import Run\n"
        "def f():\n    from . import ledger\n    from .buffer import make_buffer\n    import c.d\n"
    )
    known = {"nonstop.orchestrator.build", "nonstop.orchestrator.ledger", "nonstop.orchestrator.buffer"}
    found = [m for _, m in imports(src, ORCHESTRATOR, known)]
    assert sorted(found) == sorted(["typing", *known, "c.d"])
    deps = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(set(deps), deps) == [["a", "b", "c"]]
    assert circle(["a", "b", "c"], deps) == ["a", "b", "c", "a"]
