"""docs/architecture.md's "## Glossary" names code that exists, so a renamed class cannot leave it
behind.

Each entry is a line `- **word** — definition. `Name`, ...`. Checked: every word is defined once;
every name in backquotes exists in src/nonstop, read with `ast` (nothing imported):
- `path.py` or `package/`: a module or package of src/nonstop (a bare `name.py` anywhere in it);
- `section.field` (lowercase, dotted): a field of the config tree;
- any other name: a class or function (a method too) defined in the package;
and a class the glossary names is defined once in the package, so the word maps to one thing.
"""

from __future__ import annotations

import ast
import re
import typing
from collections import Counter

from pydantic import BaseModel

from nonstop.config import Config
from support.source import PACKAGE, modules

DOC = PACKAGE.parents[1] / "docs" / "architecture.md"
ENTRY = re.compile(r"^- \*\*([^*]+)\*\* — ")


def glossary(text: str | None = None) -> dict[str, list[str]]:
    """Each word of the glossary with the backquoted names of its entry, in order."""
    text = DOC.read_text() if text is None else text
    section = text.split("\n## Glossary\n", 1)[1].split("\n## ", 1)[0]
    entries: dict[str, list[str]] = {}
    words: list[str] = []
    for line in section.splitlines():
        m = ENTRY.match(line)
        if m:
            words.append(m[1].lower())
            entries[m[1].lower()] = re.findall(r"`([^`]+)`", line[m.end() :])
    twice = [w for w, n in Counter(words).items() if n > 1]
    assert not twice, f"glossary words defined twice: {twice}"
    return entries


def definitions(sources: dict[str, str]) -> tuple[Counter[str], set[str]]:
    """How many times each class name is defined, and every function and method name."""
    classes: Counter[str] = Counter()
    functions: set[str] = set()
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.ClassDef):
                classes[node.name] += 1
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.add(node.name)
    return classes, functions


def is_config_field(path: str, root: type[BaseModel] = Config) -> bool:
    """Whether `path` (`buffer.depth`) names a field of the config tree, through tagged unions."""
    models: list[type[BaseModel]] = [root]
    for part in path.split("."):
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if not fields:
            return False
        models = [t for f in fields for t in _models_in(f.annotation)]
    return True


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def missing(entries: dict[str, list[str]], sources: dict[str, str]) -> list[str]:
    """The names of `entries` that src/nonstop does not hold as the glossary says."""
    classes, functions = definitions(sources)
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    packages = {p.parent.relative_to(PACKAGE).as_posix() + "/" for p in PACKAGE.rglob("__init__.py")}
    bad = []
    for word, names in entries.items():
        if not names:
            bad.append(f"{word}: names no code")
        for name in names:
            if name.endswith(".py"):
                ok = name in files or ("/" not in name and any(f.endswith("/" + name) for f in files))
            elif name.endswith("/"):
                ok = name in packages
            elif re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", name):
                ok = is_config_field(name)
            else:
                ok = classes[name] == 1 or (name not in classes and name in functions)
                if classes[name] > 1:
                    bad.append(f"{word}: class {name} is defined {classes[name]} times")
                    continue
            if not ok:
                bad.append(f"{word}: {name} is not in src/nonstop")
    return bad


def test_every_name_in_the_glossary_exists_once() -> None:
    entries = glossary()
    assert {"group", "sample", "episode", "policy version", "publisher", "receiver"} <= set(entries)
    sources = {m: p.read_text() for m, p in modules().items()}
    found = missing(entries, sources)
    assert not found, "docs/architecture.md's glossary:\n" + "\n".join(found)


def test_the_glossary_check_can_fail() -> None:
    """A missing class, a class defined twice, a missing module, package and config field, and an
    entry with no code are each reported; what exists is not."""
    sources = {"a": "class Group: ...\nclass Seq: ...\ndef split(): ...\n", "b": "class Seq: ...\n"}
    entries = {
        "good": ["Group", "split", "errors.py", "engine/sampling.py", "transport/", "buffer.depth", "engine.vllm"],
        "gone": ["Gone"],
        "twice": ["Seq"],
        "module": ["nowhere.py"],
        "package": ["nowhere/"],
        "field": ["buffer.depht"],
        "none": [],
    }
    found = missing(entries, sources)
    assert [f.split(":")[0] for f in found] == ["gone", "twice", "module", "package", "field", "none"], found
    text = "x\n## Glossary\n\n- **group** — one. `Group`.\n- **Group** — two. `Group`.\n"
    try:
        glossary(text)
    except AssertionError as e:
        assert "defined twice" in str(e)
    else:
        raise AssertionError("a word defined twice passed")
