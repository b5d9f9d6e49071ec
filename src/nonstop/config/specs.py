"""Resolve user-given ``package.module:attr`` specs to callables.

Rewards, environments and scorers are all named this way in a config. Every caller has its own
error type (a bad reward is a RewardError, a bad environment a ConfigError), so the caller passes
it in; the message always names the config field, the spec, and why it failed.

A spec resolves as `python -m` run in the user's folder would find it: a module that is not on the
Python path is looked for in `folder` (the current folder unless given), which is then added at
the end of sys.path, so nothing installed is shadowed. `nonstop` is a console script, whose
sys.path holds its own folder rather than the current one; without this, `mypkg.rewards:score`
beside the user's config would need PYTHONPATH=. set. Worker processes, whose current folder
may differ (a Ray worker's is its own), are given the user's folder (scoring/pool.py
RewardWorker).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any


def _on_path(folder: str) -> bool:
    here = os.path.realpath(folder)
    return any(os.path.realpath(p or os.curdir) == here for p in sys.path)


def _import(module_name: str, folder: str) -> ModuleType:
    """`module_name` from sys.path, else from `folder` (then kept on sys.path: functions pickled by
    reference are imported again by name)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        top = module_name.partition(".")[0]
        there = (Path(folder) / top).is_dir() or (Path(folder) / f"{top}.py").is_file()
        if e.name != top or not there or _on_path(folder):
            raise
    sys.path.append(folder)
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def import_callable(
    spec: str, field: str, error: type[Exception], kind: str, known: Iterable[str] = (), folder: str | None = None
) -> Callable[..., Any]:
    """The callable that ``spec`` ('package.module:attr') names; raises ``error`` naming ``field``.

    ``kind`` names what is looked up ("reward", "environment") and ``known`` the built-in names the
    caller accepts instead of a spec, both for the message when ``spec`` is neither. ``folder``: where
    the user runs nonstop (default: the current folder), searched after sys.path.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{field}: unknown {kind} {spec!r}; use one of {sorted(known)} or 'package.module:name'")
    folder = folder or os.getcwd()
    try:
        obj = getattr(_import(module_name, folder), attr)
    except ModuleNotFoundError as e:
        top = module_name.partition(".")[0]
        hint = (
            f" ('{top}' is neither installed nor in {folder}: run nonstop from the folder that holds "
            f"{top}/ or {top}.py, add that folder to PYTHONPATH, or pip install your package)"
            if e.name == top
            else ""
        )
        raise error(f"{field}: cannot import {spec!r}: {e}{hint}") from None
    except (ImportError, AttributeError) as e:
        raise error(f"{field}: cannot import {spec!r}: {e}") from None
    if not callable(obj):
        raise error(f"{field}: {spec!r} is not callable")
    return obj
