"""Resolve user-given ``package.module:attr`` specs to callables.

Rewards, environments and scorers are all named this way in a config. Every caller has its own
error type (a bad reward is a RewardError, a bad environment a ConfigError), so the caller passes
it in; the message always names the config field, the spec, and why it failed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any


def import_callable(
    spec: str, field: str, error: type[Exception], kind: str, known: Iterable[str] = ()
) -> Callable[..., Any]:
    """The callable that ``spec`` ('package.module:attr') names; raises ``error`` naming ``field``.

    ``kind`` names what is looked up ("reward", "environment") and ``known`` the built-in names the
    caller accepts instead of a spec, both for the message when ``spec`` is neither.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{field}: unknown {kind} {spec!r}; use one of {sorted(known)} or 'package.module:name'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise error(f"{field}: cannot import {spec!r}: {e}") from None
    if not callable(obj):
        raise error(f"{field}: {spec!r} is not callable")
    return obj
