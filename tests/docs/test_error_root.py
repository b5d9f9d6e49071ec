"""Every exception class defined in src/nonstop derives from `NonstopError` (src/nonstop/errors.py),
so `except NonstopError` (the command line's one-line message) catches every error nonstop raises
on purpose.

The source is read with `ast`, nothing imported, so the modules of optional extras (vLLM, Ray) are
checked too. A class is an exception when one of its bases is a built-in exception or an exception
class of ours, followed by name through the whole package; a warning (a `Warning` subclass) is a
message, not an error, and is left out.
"""

from __future__ import annotations

import ast
import builtins

from support.source import modules

ROOT = "NonstopError"
BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
WARNINGS = {n for n in BUILTIN_EXCEPTIONS if issubclass(getattr(builtins, n), Warning)}


def class_bases(sources: dict[str, str]) -> dict[str, set[str]]:
    """Each class name defined in `sources` (module -> text), with the last dotted part of every
    base any class of that name lists (`rex.RayActorError` is `RayActorError`)."""
    bases: dict[str, set[str]] = {}
    for module, text in sources.items():
        for node in ast.walk(ast.parse(text, module)):
            if isinstance(node, ast.ClassDef):
                names = bases.setdefault(node.name, set())
                for base in node.bases:
                    if isinstance(base, ast.Name):
                        names.add(base.id)
                    elif isinstance(base, ast.Attribute):
                        names.add(base.attr)
    return bases


def reaches(name: str, targets: set[str], bases: dict[str, set[str]]) -> bool:
    """Whether class `name`, or a base of it followed by name, is one of `targets`."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(bases.get(n, ()))
    return False


def strays(sources: dict[str, str]) -> list[str]:
    """The exception classes of `sources` that do not derive from NonstopError (warnings aside)."""
    bases = class_bases(sources)
    return sorted(
        name
        for name in bases
        if name != ROOT
        and reaches(name, BUILTIN_EXCEPTIONS, bases)
        and not reaches(name, WARNINGS, bases)
        and not reaches(name, {ROOT}, bases)
    )


def test_every_exception_class_derives_from_nonstop_error() -> None:
    sources = {m: p.read_text() for m, p in modules().items()}
    bases = class_bases(sources)
    assert ROOT in bases and len([n for n in bases if reaches(n, {ROOT}, bases)]) > 20
    found = strays(sources)
    assert not found, f"exception classes outside NonstopError (src/nonstop/errors.py): {found}"


def test_the_check_can_fail() -> None:
    """A direct built-in subclass, one through a class of ours and one through a dotted base are
    found; a subclass of the root (by a chain), a warning and a plain class are not."""
    source = """
class NonstopError(Exception): ...
class AreaError(NonstopError): ...
class Fine(AreaError, ValueError): ...
class Stray(RuntimeError): ...
class StrayChild(Stray): ...
class Dotted(builtins.TimeoutError): ...
class Note(UserWarning): ...
class Plain: ...
"""
    assert strays({"m": source}) == ["Dotted", "Stray", "StrayChild"]
