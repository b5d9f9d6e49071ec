"""The request shapes of `nonstop serve`, as pydantic models: one schema validates, documents, fuzzes.

`CompletionRequest` (`POST /v1/completions`), `ChatRequest` (`POST /v1/chat/completions`) and
`GenerateRequest` (vLLM's `POST /inference/v1/generate`) hold every field the server reads, the
OpenAI ones, nonstop's extensions (`top_k`, `min_p`, `stop_token_ids`, `prompt_token_ids`) and
the OpenAI fields nonstop cannot honour, which are accepted at their neutral value only (a 400
naming the field otherwise, never ignored). `validate(model, body)` checks a decoded JSON body
(strict: no string for a number, no boolean for an integer) and raises `BadRequest` naming the
first bad field as a path (`messages[0].content[1].type`). The same models give the JSON schema
that serve/openapi.py publishes at `/openapi.json` and that the fuzz tests generate requests from.

Text anywhere must be valid Unicode (JSON lets a lone surrogate through; tokenizers refuse it).
A field that takes several JSON kinds (a string or a list) chooses its member by the value's
kind, so an error names the member the value meant, not every member it did not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Tag,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, ErrorDetails, PydanticCustomError, core_schema


class BadRequest(ValueError):
    """A request the server rejects with 400 (or `status`); the message names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


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


def _by_kind(expected: str, *tags: str) -> Discriminator:
    """Choose a union member by the value's JSON kind; any other kind: `expected`."""

    def tag(v: Any) -> str | None:
        k = _kind(v)
        return k if k in tags else None

    return Discriminator(tag, custom_error_type="expected", custom_error_message=expected)


def _prompt_kind(v: Any) -> str | None:
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
    _by_kind(f"expected a string or a list of at most {MAX_STOP_STRINGS} strings", "string", "array"),
]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
M = TypeVar("M", bound=BaseModel)


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


def _zero_or_one(v: Any) -> Any:
    """Legacy `logprobs` N asks for the N most likely alternatives too, which nonstop does not have."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 1:
        raise PydanticCustomError(
            "unsupported",
            "expected 0 or 1, got {got} (nonstop returns the sampled token's logprob only, not alternatives)",
            {"got": _short(v)},
        )
    return v


class _Body(BaseModel):
    """Strict JSON types; keys the server does not know are kept and reported (server.py logs them)."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, use_attribute_docstrings=True)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, use_attribute_docstrings=True)

    include_usage: bool = False
    """A last streamed chunk with the usage and no choices."""


class SamplingFields(_Body):
    """The fields both OpenAI routes share."""

    model: Text | None = None
    """The served model's id; any other is a 404."""
    max_tokens: Positive | None = None
    """Completion tokens at most (default: rollout.max_new_tokens); with the prompt, within the engine's max_seq_len."""
    max_completion_tokens: Positive | None = None
    """The same as max_tokens (OpenAI's newer name); wins when both are given."""
    temperature: Temperature | None = None
    """0: greedy."""
    top_p: TopP | None = None
    top_k: TopK | None = None
    """nonstop extension: keep the k most likely tokens (0 or -1: off)."""
    min_p: MinP | None = None
    """nonstop extension: keep tokens with probability >= min_p x the most likely token's."""
    n: N | None = None
    """Completions of the one prompt."""
    seed: Seed | None = None
    """Completion i samples with seed + i."""
    stop: Stop | None = None
    """Text ends before the first of these strings (empty strings are ignored)."""
    stop_token_ids: StopTokenIds | None = None
    """nonstop extension: finish after sampling one of these token ids."""
    stream: bool | None = None
    """Server-sent events, one chunk per token, then `data: [DONE]`."""
    stream_options: StreamOptions | None = None
    """Only with stream: true."""
    user: Text | None = None
    """Accepted and not used."""
    presence_penalty: Annotated[Any, Unsupported(0)] = None
    """Not supported: 0 only."""
    frequency_penalty: Annotated[Any, Unsupported(0)] = None
    """Not supported: 0 only."""
    repetition_penalty: Annotated[Any, Unsupported(1)] = None
    """Not supported: 1 only."""
    logit_bias: Annotated[Any, Unsupported({})] = None
    """Not supported: {} only."""
    echo: Annotated[Any, Unsupported(False)] = None
    """Not supported: false only."""
    suffix: Annotated[Any, Unsupported("")] = None
    """Not supported: "" only."""
    best_of: Positive | None = None
    """Not supported: equal to n only."""
    tools: Annotated[Any, Unsupported([])] = None
    """Not supported (nonstop serves no tools): [] only."""
    functions: Annotated[Any, Unsupported([])] = None
    """Not supported: [] only."""
    tool_choice: Annotated[Any, Unsupported("none")] = None
    """Not supported: "none" only."""
    parallel_tool_calls: Annotated[Any, Unsupported(None)] = None
    """Not supported: null only."""
    response_format: Annotated[Any, Unsupported({"type": "text"})] = None
    """Not supported: {"type": "text"} only."""
    prediction: Annotated[Any, Unsupported(None)] = None
    """Not supported: null only."""
    audio: Annotated[Any, Unsupported(None)] = None
    """Not supported: null only."""
    modalities: Annotated[Any, Unsupported(["text"])] = None
    """Not supported: ["text"] only."""

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise PydanticCustomError("stream_options", 'only allowed with "stream": true')
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and v != (info.data.get("n") or 1):
            raise PydanticCustomError(
                "unsupported", "not supported by nonstop serve (send the same value as n, or leave it out)"
            )
        return v


_ONE_PROMPT = {"minItems": 1, "maxItems": 1}
"""A batch of prompts is refused unless it holds one (checked in CompletionRequest, documented here)."""


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        frozen=True,
        use_attribute_docstrings=True,
        # exactly one of prompt and prompt_token_ids, not null
        json_schema_extra={
            "oneOf": [
                {"required": [key], "properties": {key: {"not": {"type": "null"}}}}
                for key in ("prompt", "prompt_token_ids")
            ]
        },
    )

    prompt: (
        Annotated[
            Union[
                Annotated[Text, Tag("string"), Field(json_schema_extra={"minLength": 1})],
                Annotated[list[TokenId], Tag("ids"), Field(json_schema_extra={"minItems": 1})],
                Annotated[list[Text], Tag("texts"), Field(json_schema_extra=_ONE_PROMPT)],
                Annotated[list[list[TokenId]], Tag("batch"), Field(json_schema_extra=_ONE_PROMPT)],
            ],
            Discriminator(
                _prompt_kind,
                custom_error_type="expected",
                custom_error_message="expected a non-empty string or list of token ids",
            ),
        ]
        | None
    ) = None
    """Text, or token ids; a list holding one of either is a batch of one (one prompt per request)."""
    prompt_token_ids: Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})] | None = None
    """nonstop extension: the prompt as token ids (instead of prompt)."""
    logprobs: (
        Annotated[
            Union[Annotated[bool, Tag("boolean")], Annotated[ZeroOrOne, Tag("integer")]],
            _by_kind("expected 0, 1, true or false", "boolean", "integer"),
        ]
        | None
    ) = None
    """0 or 1: the sampled token's behaviour logprob (nonstop has no alternatives to return)."""

    _no_alternatives = field_validator("logprobs", mode="before")(lambda v: _zero_or_one(v))

    @model_validator(mode="after")
    def _one_prompt(self) -> CompletionRequest:
        p, ids = self.prompt, self.prompt_token_ids
        if p is not None and ids is not None:
            raise _at("prompt_token_ids", "give prompt or prompt_token_ids, not both")
        if ids is not None:
            p = ids
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > 1:
                raise _at("prompt", f"one prompt per request (got {len(p)}); send one request per prompt")
            p = p[0]
        if p is None:
            raise _at("prompt", "required: a string or a list of token ids")
        if not p:
            raise _at(
                "prompt_token_ids" if ids is not None else "prompt", "expected a non-empty string or list of token ids"
            )
        return self

    @property
    def the_prompt(self) -> str | list[int]:
        """The one prompt, unwrapped from a batch of one."""
        p: Any = self.prompt_token_ids if self.prompt_token_ids is not None else self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            p = p[0]  # validated: a batch holds exactly one prompt
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", frozen=True, use_attribute_docstrings=True)

    type: Annotated[Literal["text"], BeforeValidator(lambda v: _text_only(v))]
    text: Text


def _text_only(v: Any) -> Any:
    if v != "text":
        raise PydanticCustomError(
            "text_only", 'expected "text" (got {got}; nonstop serves text only)', {"got": _short(v)}
        )
    return v


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    """One message: text content (a string or text parts, joined with newlines)."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        frozen=True,
        use_attribute_docstrings=True,
        json_schema_extra={
            "if": {"properties": {"role": {"const": "tool"}}},
            "then": {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}},
        },
    )

    role: Role
    content: Annotated[
        Union[Annotated[Text, Tag("string")], Annotated[list[TextPart], Field(min_length=1), Tag("array")]],
        _by_kind("expected a string or a non-empty list of text parts", "string", "array"),
    ]
    name: Text | None = None
    """Passed to the chat template."""
    tool_call_id: Annotated[Text, Field(min_length=1)] | None = None
    """Required on tool messages: the call this message answers."""
    tool_calls: Annotated[Any, Unsupported([])] = None
    """Not supported (nonstop serves no tools): [] only."""

    @model_validator(mode="after")
    def _tool_answers_a_call(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise _at("tool_call_id", "a tool message needs the tool_call_id of the call it answers")
        return self

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "\n".join(part.text for part in c)


class ChatRequest(SamplingFields):
    """`POST /v1/chat/completions`: a conversation through the model's chat template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: bool | None = None
    """The sampled tokens' behaviour logprobs."""
    top_logprobs: Annotated[int, Field(ge=0, le=0), _WHOLE] | None = None
    """0 only, with logprobs: true (nonstop has no alternatives to return)."""

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _no_alternatives(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            raise PydanticCustomError(
                "unsupported",
                "not supported (nonstop returns the sampled token's behaviour logprob only; send 0 or leave it out)",
            )
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise PydanticCustomError("top_logprobs", 'needs "logprobs": true')
        return v


class GenerateSamplingParams(BaseModel):
    """vLLM's sampling_params as `/inference/v1/generate` takes them."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, use_attribute_docstrings=True)
    EXTRA: ClassVar[str] = "unknown sampling parameter"

    max_tokens: Positive | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    """0 or -1: off."""
    min_p: MinP | None = None
    seed: Seed | None = None
    n: N | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    logprobs: ZeroOrOne | None = None
    """0 or 1: the sampled token's behaviour logprob (no alternatives)."""
    _no_alternatives = field_validator("logprobs", mode="before")(lambda v: _zero_or_one(v))
    # keys that change neither the tokens sampled nor their logprobs
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    detokenize: Any = None
    include_stop_str_in_output: Any = None
    routed_experts_prompt_start: Any = None
    return_sampling_mask: Any = None
    # keys nonstop does not implement, accepted at their neutral value
    presence_penalty: Annotated[Any, Unsupported(0)] = None
    frequency_penalty: Annotated[Any, Unsupported(0)] = None
    repetition_penalty: Annotated[Any, Unsupported(1)] = None
    logit_bias: Annotated[Any, Unsupported(None)] = None
    ignore_eos: Annotated[Any, Unsupported(False)] = None
    min_tokens: Annotated[Any, Unsupported(0)] = None
    prompt_logprobs: Annotated[Any, Unsupported(None)] = None
    bad_words: Annotated[Any, Unsupported(None)] = None
    allowed_token_ids: Annotated[Any, Unsupported(None)] = None
    structured_outputs: Annotated[Any, Unsupported(None)] = None
    guided_decoding: Annotated[Any, Unsupported(None)] = None


class GenerateRequest(BaseModel):
    """vLLM's `POST /inference/v1/generate`: token ids in, token ids and logprobs out."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, use_attribute_docstrings=True)
    EXTRA: ClassVar[str] = "not supported by nonstop's /inference/v1/generate (text token ids only)"

    model: Text | None = None
    token_ids: Annotated[list[TokenId], Field(min_length=1)]
    sampling_params: GenerateSamplingParams | None = None
    request_id: Text | None = None
    cache_salt: Any = None
    """Accepted (the built-in engine has no shared prefix cache to salt)."""
    priority: Any = None
    """Accepted (the built-in engine has no priorities)."""
    stream: Annotated[Any, Unsupported(False)] = None
    """Not supported: false only (one JSON answer)."""


def _at(field: str, message: str) -> PydanticCustomError:
    """An error a model validator raises for one of its fields (its location names only the model)."""
    return PydanticCustomError("field", "{message}", {"message": message, "at": field})


def _short(v: Any) -> str:
    text = ascii(v)
    return text if len(text) <= 40 else text[:37] + "..."


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
    kind, ctx, got = e["type"], e.get("ctx") or {}, _short(e.get("input"))
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
        extra = getattr(model, "EXTRA", None) if e["type"] == "extra_forbidden" else None
        if e["type"] == "extra_forbidden":
            nested = loc[0] == "sampling_params" and len(loc) > 1
            message = GenerateSamplingParams.EXTRA if nested else (extra or "unknown field")
        else:
            message = _message(e)
        at = (e.get("ctx") or {}).get("at")
        path, param = _path(loc, at)
        raise BadRequest(f"{path}: {message}" if path else message, param) from None
