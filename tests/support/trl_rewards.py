"""Reward functions with TRL's signature, importable by name (`support.trl_rewards:...`) from test
configs and from reward worker processes.

`recorded` writes down every call it gets, so a test can check what nonstop passed: the rows name
the file in their `log` column (a column, so that a run of the CLI needs no environment of its own).
"""

from __future__ import annotations

import json
from typing import Any


def _text(completion: Any) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def recorded(prompts: list, completions: list, completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
    """The completion's length in tokens, capped at 3, or None for rows whose `kind` is 'none'; each
    call appended as one JSON line to the file named by the rows' `log` column (when they have one)."""
    values: list[float | None] = [
        None if kind == "none" else float(min(len(ids), 3)) for kind, ids in zip(kwargs["kind"], completion_ids)
    ]
    if kwargs.get("log"):
        call = {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "columns": sorted(kwargs),
            "row_ids": kwargs.get("row_id"),
            "values": values,
        }
        with open(kwargs["log"][0], "a") as f:
            f.write(json.dumps(call) + "\n")
    return values


def says_yes(completions: list, **kwargs: Any) -> list[float | None]:
    """1.0 when the completion contains 'yes', None for rows whose `kind` is 'none' or 'half'."""
    return [None if k in ("none", "half") else float("yes" in _text(c)) for c, k in zip(completions, kwargs["kind"])]


def parity(completions: list, completion_ids: list[list[int]], **kwargs: Any) -> list[float | None]:
    """The parity of the first completion token: rewards that differ within a group (a learning signal)."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


def never(completions: list, **kwargs: Any) -> list[float | None]:
    """None for every completion: no sample has a reward."""
    return [None] * len(completions)


def wrong_length(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) + 1)
