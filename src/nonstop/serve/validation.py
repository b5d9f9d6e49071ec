"""Request validation for `nonstop serve`: a decoded JSON body against a request model of
serve/schema.py, or `BadRequest` (a 4xx) whose message names the first bad field as a path
(`messages[0].content[1].type`) and whose `param` is the path's leading names (`messages`,
`sampling_params.top_k`), worded for a client rather than in pydantic's terms.
"""

from __future__ import annotations

import typing
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from nonstop.errors import ServeError
from nonstop.serve.fields import UNION_TAGS, short

M = TypeVar("M", bound=BaseModel)


class BadRequest(ServeError, ValueError):
    """A request the server rejects with 400 (or `status`); the message names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def _extra(model: type[BaseModel], loc: tuple[Any, ...]) -> str:
    """The refusal of a key `model` (or the nested model at `loc`) does not take: its EXTRA."""
    target = model
    for part in loc[:-1]:
        field = target.model_fields.get(part) if isinstance(part, str) else None
        nested = (
            [t for t in typing.get_args(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
            if field
            else []
        )
        if not nested:
            break
        target = nested[0]
    return str(getattr(target, "EXTRA", "unknown field"))


_EXPECTED = {
    "missing": "required",
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "string_unicode": "not valid Unicode text",
    "list_type": "expected a list",
    "dict_type": "expected an object",
    "model_type": "expected an object",
    "model_attributes_type": "expected an object",
    "finite_number": "expected a finite number",
    "none_required": "expected null",
}


def _message(e: ErrorDetails) -> str:
    kind, ctx, got = e["type"], e.get("ctx") or {}, short(e.get("input"))
    if kind in _EXPECTED:
        return _EXPECTED[kind] + ("" if kind in ("missing", "string_unicode") else f", got {got}")
    bounds = {
        "greater_than": "above {gt}",
        "greater_than_equal": "at least {ge}",
        "less_than": "below {lt}",
        "less_than_equal": "at most {le}",
    }
    if kind in bounds:
        return f"{got} is out of range: expected a value {bounds[kind].format(**ctx)}"
    if kind == "too_long":
        return f"at most {ctx.get('max_length')} items (got {ctx.get('actual_length')})"
    if kind == "string_too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else f"at least {ctx.get('min_length')} characters"
    if kind == "too_short":
        return "must not be empty" if ctx.get("min_length") == 1 else f"at least {ctx.get('min_length')} items"
    if kind == "literal_error":
        return f"expected {ctx.get('expected')}, got {got}"
    return str(e["msg"]).removeprefix("Value error, ")


def _path(loc: tuple[Any, ...], at: str | None) -> tuple[str, str | None]:
    """`messages[0].content` from pydantic's location (union tags dropped), and the `param`:
    the path's leading field names (`messages`, `sampling_params.stop`)."""
    path, param, indexed = "", None, False
    for part in (*loc, *([at] if at else [])):
        if isinstance(part, int):
            path, indexed = f"{path}[{part}]", True
        elif part not in UNION_TAGS:
            path = f"{path}.{part}" if path else str(part)
            if not indexed:
                param = path
    return path, param


def validate(model: type[M], body: Any) -> M:
    """`body` (decoded JSON) as `model`, or BadRequest naming the first bad field."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        e = err.errors(include_url=False)[0]
        loc = tuple(e["loc"])
        if not loc and e["type"] in ("model_type", "model_attributes_type", "dict_type"):
            raise BadRequest("request body: expected a JSON object") from None
        message = _extra(model, loc) if e["type"] == "extra_forbidden" else _message(e)
        at = (e.get("ctx") or {}).get("at")
        path, param = _path(loc, at)
        raise BadRequest(f"{path}: {message}" if path else message, param) from None
