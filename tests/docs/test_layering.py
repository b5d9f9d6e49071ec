"""The layer order declared in docs/architecture.md ("## Layers") holds for every import of every module.

The source is read with `ast` (nothing is imported), and every import counts: at module level,
inside functions and under `if TYPE_CHECKING:` (tests/support/source.py). Checked:
- the list names every package and root module once, and only modules that exist;
- no import runs up the order, or sideways to another unit of the same layer;
- the orchestrator's modules import each other without a circle, in the order its package
  docstring lists them, so each can be read after the ones it builds on.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from support.source import PACKAGE, Import, all_imports, imports_in, modules, ours

DOC = PACKAGE.parents[1] / "docs" / "architecture.md"
ORCHESTRATOR = "nonstop.orchestrator"

Layers = list[list[str]]


def declared_layers(text: str | None = None) -> Layers:
    """The units of each layer, bottom first, as the "## Layers" section lists them: each line
    `N. `unit`, `unit` — why`, its units the backquoted names before the dash."""
    text = DOC.read_text() if text is None else text
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    layers: Layers = []
    for line in section.splitlines():
        m = re.match(r"^(\d+)\. (.+?) — ", line)
        if m:
            assert int(m[1]) == len(layers) + 1, f"docs/architecture.md's layers are not numbered in order at {line!r}"
            layers.append(re.findall(r"`([^`]+)`", m[2]))
    return layers


def members(unit: str) -> list[str]:
    """The dotted module prefixes a unit names: `nonstop` is the package's own `__init__.py`,
    `config.{machine,shape}` is two modules of config/, any other name one package or module."""
    if unit == "nonstop":
        return ["nonstop"]
    m = re.fullmatch(r"([\w.]+)\.\{([\w,]+)\}", unit)
    names = [f"{m[1]}.{x}" for x in m[2].split(",")] if m else [unit]
    return [f"nonstop.{n}" for n in names]


def unit_of(module: str, layers: Layers) -> str | None:
    """The unit that names `module`: the one naming the longest prefix of it (the root package
    `nonstop` names only itself)."""
    best: tuple[int, str] | None = None
    for layer in layers:
        for unit in layer:
            for prefix in members(unit):
                hit = module == prefix or (prefix != "nonstop" and module.startswith(prefix + "."))
                if hit and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), unit)
    return best[1] if best else None


def against_the_order(imports: list[Import], layers: Layers) -> list[str]:
    """Each import of ours that goes to a unit of the same or a higher layer than its module's."""
    level = {unit: n for n, layer in enumerate(layers, 1) for unit in layer}
    bad = []
    for imp in imports:
        if not ours(imp.target):
            continue
        here, there = unit_of(imp.module, layers), unit_of(imp.target, layers)
        if here is None or there is None:
            bad.append(f"{imp.where} imports {imp.target}: a module the layer list does not name")
        elif here != there and level[there] >= level[here]:
            way = "up" if level[there] > level[here] else "sideways"
            bad.append(
                f"{imp.where} ({here}, layer {level[here]}) imports {imp.target} ({there}, layer {level[there]}): {way}"
            )
    return bad


def test_the_layer_list_names_every_package_and_root_module_once() -> None:
    layers = declared_layers()
    units = [u for layer in layers for u in layer]
    assert len(layers) > 10 and len(units) == len(set(units)), units
    mods = modules()
    for unit in units:
        for prefix in members(unit):
            assert any(m == prefix or m.startswith(prefix + ".") for m in mods), f"layer unit {unit}: no {prefix}"
    unplaced = sorted(m for m in mods if unit_of(m, layers) is None)
    assert not unplaced, f"docs/architecture.md's layers do not place {unplaced}"
    tops = {m.split(".")[1] for m in mods if m != "nonstop"}
    assert tops <= {u.split(".")[0] for u in units}, sorted(tops - set(units))


def test_no_import_runs_up_the_layers() -> None:
    found = against_the_order(all_imports(), declared_layers())
    assert not found, "imports against docs/architecture.md's layer order:\n" + "\n".join(found)


def test_the_layer_check_can_fail() -> None:
    """An upward import, a sideways one and an import of a module the list does not place are
    each reported; an import down the order, or within a unit, is not."""
    layers = [["config"], ["engine", "trainer"], ["orchestrator"]]
    here = Path("nonstop/engine/core.py")
    cases = {
        "nonstop.config": False,
        "nonstop.engine.blocks": False,
        "nonstop.trainer.losses": True,
        "nonstop.orchestrator.run": True,
        "nonstop.nowhere": True,
    }
    imps = [Import("nonstop.engine.core", PACKAGE / "engine" / "core.py", n, t, (), True) for n, t in enumerate(cases)]
    found = against_the_order(imps, layers)
    assert [t for t, bad in cases.items() if bad] == [t for t in cases if any(t in f for f in found)], found
    assert "sideways" in found[0] and "up" in found[1], (found, here)
    assert unit_of("nonstop.models.gguf", [["models"], ["models.{fetch,gguf}"]]) == "models.{fetch,gguf}"
    assert unit_of("nonstop.types", [["nonstop"]]) is None


def test_the_walk_sees_hidden_and_relative_imports() -> None:
    """Function-level, TYPE_CHECKING and relative imports are edges too (the checks would be blind
    without them); a from-import of a submodule names the submodule."""
    src = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from nonstop.orchestrator.build import Run\n"
        "def f():\n    from . import ledger\n    from .buffer import make_buffer\n    import c.d\n"
    )
    known = {"nonstop.orchestrator.build", "nonstop.orchestrator.ledger", "nonstop.orchestrator.buffer"}
    found = imports_in(src, "nonstop.orchestrator.fit", Path("fit.py"), False, known)
    assert [(i.target, i.names, i.in_function) for i in found] == [
        ("typing", ("TYPE_CHECKING",), False),
        ("nonstop.orchestrator.build", ("Run",), False),
        ("nonstop.orchestrator.ledger", (), True),
        ("nonstop.orchestrator.buffer", ("make_buffer",), True),
        ("c.d", (), True),
    ]


def module_graph() -> dict[str, set[str]]:
    mods = modules()
    deps: dict[str, set[str]] = {m: set() for m in mods}
    for imp in all_imports():
        if imp.target in mods and imp.target != imp.module:
            deps[imp.module].add(imp.target)
    return deps


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


def test_orchestrator_has_no_import_circle() -> None:
    deps = module_graph()
    own = {n for n in deps if n.startswith(ORCHESTRATOR + ".")}
    assert len(own) > 5  # the walk found the orchestrator's modules
    found = cycles(own, deps)
    assert not found, "import circles in the orchestrator:\n" + "\n".join(", ".join(c) for c in found)


def test_the_orchestrator_docstring_lists_its_modules_in_import_order() -> None:
    """orchestrator/__init__.py names every module once, each after every module it imports: a
    reader can go down the list and meet nothing not yet read."""
    deps = module_graph()
    doc = ast.get_docstring(ast.parse((PACKAGE / "orchestrator" / "__init__.py").read_text())) or ""
    paths = re.findall(r"^- ([\w/]+)\.py", doc, re.MULTILINE)  # a sub-package's modules as `modes/task.py`
    listed = [f"{ORCHESTRATOR}.{p.removesuffix('/__init__').replace('/', '.')}" for p in paths]
    assert sorted(listed) == sorted(n for n in deps if n.startswith(ORCHESTRATOR + ".")), listed
    late = [
        f"{m} imports {d}, listed after it" for i, m in enumerate(listed) for d in sorted(deps[m] & set(listed[i:]))
    ]
    assert not late, "\n".join(late)


def test_a_circle_is_found_whatever_module_it_is_entered_from() -> None:
    deps = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(set(deps), deps) == [["a", "b", "c"]]
    assert cycles({"b", "c", "d"}, deps) == []
