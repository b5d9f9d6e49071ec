"""The field types of `nonstop serve`'s request models (serve/schema.py): each one validates a
JSON value and documents it in the JSON schema with the same bounds.

- `Text`: a string that is valid Unicode (JSON lets a lone surrogate through; tokenizers refuse it);
- integers (`TokenId`, `Positive`, `TopK`, `N`, `ZeroOrOne`, `Seed`): not booleans, and a number
  without a fraction is one (16.0 is 16, as JSON Schema reads it);
- `Temperature`, `TopP`, `MinP`: the ranges the engine's float32 sampling handles;
- `Stop`, `StopTokenIds`: stop strings and token ids, capped;
- `by_kind(...)`: a union that picks its member by the value's JSON kind, so an error names the
  member the value meant, not every member it did not (`UNION_TAGS` are the members' tags);
- `Unsupported(neutral)`: a field nonstop does not implement, accepted at its neutral value only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Union

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Tag,
    WithJsonSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds torch's generator takes for every one of the n completions (seed + index)."""
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024
"""A request's stop token ids at most: each is checked after every sampled token."""
MAX_N = 128


def _unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "unicode", "not valid Unicode text ({reason} at character {start})", {"reason": e.reason, "start": e.start}
        ) from None
    return v


def _whole(v: Any) -> Any:
    """A JSON number without a fraction is an integer, as JSON Schema reads it: 16.0 is 16."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


Text = Annotated[str, AfterValidator(_unicode)]
"""A string that is valid Unicode."""
# Integers are not booleans, and 16.0 is 16. The bounds come before the conversion, so that the
# JSON schema carries them as minimum / maximum.
_WHOLE = BeforeValidator(_whole)
TokenId = Annotated[int, Field(ge=0, lt=2**31), _WHOLE]
Positive = Annotated[int, Field(ge=1), _WHOLE]
TopK = Annotated[int, Field(ge=-1, lt=2**31), _WHOLE]
"""0 or -1: off."""
N = Annotated[int, Field(ge=1, le=MAX_N), _WHOLE]
ZeroOrOne = Annotated[int, Field(ge=0, le=1), _WHOLE]
Zero = Annotated[int, Field(ge=0, le=0), _WHOLE]
MIN_TEMPERATURE = 1e-6
"""Temperatures are 0 (greedy) or at least this: the engine divides float32 logits by it, and a
temperature such as 1e-40 overflows them to inf (NaN logprobs; found by the fuzz test)."""


def _temperature(v: float) -> float:
    if 0.0 < v < MIN_TEMPERATURE:
        raise PydanticCustomError(
            "temperature", "{got} is below {least}: send 0 for greedy decoding", {"got": v, "least": MIN_TEMPERATURE}
        )
    return v


Temperature = Annotated[
    float,
    Field(ge=0.0, le=100.0, allow_inf_nan=False),
    AfterValidator(_temperature),
    WithJsonSchema({"anyOf": [{"const": 0}, {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 100.0}]}),
]
"""0: greedy."""
TopP = Annotated[float, Field(ge=1e-9, le=1.0, allow_inf_nan=False)]
"""At least 1e-9: the engine keeps it as float32, where 1e-50 is 0 and keeps no token."""
MinP = Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1]), _WHOLE]


def _kind(v: Any) -> str | None:
    """The JSON kind of a decoded value: the tag of the union member meant to take it."""
    if isinstance(v, float) and v.is_integer():
        return "integer"
    for tag, kinds in (("boolean", bool), ("integer", int), ("number", float), ("string", str), ("array", list)):
        if isinstance(v, kinds):
            return tag
    return "object" if isinstance(v, dict) else None


def by_kind(expected: str, *tags: str) -> Discriminator:
    """Choose a union member by the value's JSON kind; any other kind: `expected`."""

    def tag(v: Any) -> str | None:
        k = _kind(v)
        return k if k in tags else None

    return Discriminator(tag, custom_error_type="expected", custom_error_message=expected)


def prompt_kind(v: Any) -> str | None:
    if isinstance(v, str):
        return "string"
    if not isinstance(v, list):
        return None
    first = _kind(v[0]) if v else "integer"
    return {"integer": "ids", "string": "texts", "array": "batch"}.get(first or "")


UNION_TAGS = frozenset({"boolean", "integer", "number", "string", "array", "object", "ids", "texts", "batch"})
"""Tags of union members, which appear in pydantic's error locations and not in field paths."""

Stop = Annotated[
    Union[Annotated[Text, Tag("string")], Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS), Tag("array")]],
    by_kind(f"expected a string or a list of at most {MAX_STOP_STRINGS} strings", "string", "array"),
]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 0 and 0.0 are the same number, false and 0 are not the same value."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    numbers = isinstance(a, (int, float)) and isinstance(b, (int, float))
    return (numbers or type(a) is type(b)) and a == b


@dataclass(frozen=True, eq=False)  # by identity: typing caches Annotated[...] by equal metadata, and 0 == False
class Unsupported:
    """Marks a field nonstop does not implement: only `neutral` (or null) is accepted, which the
    JSON schema says too, so generated requests are valid and invalid ones are refused."""

    neutral: Any

    def check(self, v: Any) -> Any:
        if v is not None and not _same(v, self.neutral):
            raise PydanticCustomError(
                "unsupported",
                "not supported by nonstop serve (send {neutral} or leave it out)",
                {"neutral": json.dumps(self.neutral)},
            )
        return v

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_before_validator_function(self.check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        only = [{"const": self.neutral}] if self.neutral is not None else []
        return {"anyOf": [*only, {"type": "null"}]}


def zero_or_one(v: Any) -> Any:
    """Legacy `logprobs` N asks for the N most likely alternatives too, which nonstop does not have."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 1:
        raise PydanticCustomError(
            "unsupported",
            "expected 0 or 1, got {got} (nonstop returns the sampled token's logprob only, not alternatives)",
            {"got": short(v)},
        )
    return v


def short(v: Any) -> str:
    text = ascii(v)
    return text if len(text) <= 40 else text[:37] + "..."
