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
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, TypeVar, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError


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


Text = Annotated[str, AfterValidator(_unicode)]
"""A string that is valid Unicode."""
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
Probability = Annotated[float, Field(allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


def _kind(v: Any) -> str | None:
    """The JSON kind of a decoded value: the tag of the union member meant to take it."""
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


def _unsupported(neutral: Any, accept: Callable[[Any], bool] | None = None) -> Any:
    """A field nonstop does not implement: only `neutral` (or null) is accepted."""

    def check(v: Any) -> Any:
        if v is not None and v != neutral and not (accept and accept(v)):
            raise PydanticCustomError(
                "unsupported",
                "not supported by nonstop serve (send {neutral} or leave it out)",
                {"neutral": json.dumps(neutral)},
            )
        return v

    return BeforeValidator(check)


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
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    """Completion tokens at most (default: rollout.max_new_tokens); with the prompt, within the engine's max_seq_len."""
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    """The same as max_tokens (OpenAI's newer name); wins when both are given."""
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] | None = None
    """0: greedy."""
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    """nonstop extension: keep the k most likely tokens (0 or -1: off)."""
    min_p: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] | None = None
    """nonstop extension: keep tokens with probability >= min_p x the most likely token's."""
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
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
    presence_penalty: Annotated[float | None, _unsupported(0)] = None
    """Not supported: 0 only."""
    frequency_penalty: Annotated[float | None, _unsupported(0)] = None
    """Not supported: 0 only."""
    repetition_penalty: Annotated[float | None, _unsupported(1)] = None
    """Not supported: 1 only."""
    logit_bias: Annotated[dict[str, Any] | None, _unsupported({})] = None
    """Not supported: {} only."""
    echo: Annotated[bool | None, _unsupported(False)] = None
    """Not supported: false only."""
    suffix: Annotated[str | None, _unsupported("")] = None
    """Not supported: "" only."""
    best_of: Annotated[int, Field(ge=1)] | None = None
    """Not supported: equal to n only."""
    tools: Annotated[list[Any] | None, _unsupported([])] = None
    """Not supported (nonstop serves no tools): [] only."""
    functions: Annotated[list[Any] | None, _unsupported([])] = None
    """Not supported: [] only."""
    tool_choice: Annotated[str | dict[str, Any] | None, _unsupported("none")] = None
    """Not supported: "none" only."""
    parallel_tool_calls: Annotated[bool | None, _unsupported(None)] = None
    """Not supported: null only."""
    response_format: Annotated[dict[str, Any] | None, _unsupported({"type": "text"})] = None
    """Not supported: {"type": "text"} only."""
    prediction: Annotated[dict[str, Any] | None, _unsupported(None)] = None
    """Not supported: null only."""
    audio: Annotated[dict[str, Any] | None, _unsupported(None)] = None
    """Not supported: null only."""
    modalities: Annotated[list[str] | None, _unsupported(["text"])] = None
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


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`: one prompt, as text or token ids."""

    model_config = ConfigDict(
        strict=True,
        extra="allow",
        frozen=True,
        use_attribute_docstrings=True,
        json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["prompt_token_ids"]}]},
    )

    prompt: (
        Annotated[
            Union[
                Annotated[Text, Tag("string")],
                Annotated[list[TokenId], Tag("ids")],
                Annotated[list[Text], Tag("texts")],
                Annotated[list[list[TokenId]], Tag("batch")],
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
    prompt_token_ids: list[TokenId] | None = None
    """nonstop extension: the prompt as token ids (instead of prompt)."""
    logprobs: (
        Annotated[
            Union[Annotated[bool, Tag("boolean")], Annotated[int, Field(ge=0, le=1), Tag("integer")]],
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

    model_config = ConfigDict(strict=True, extra="allow", frozen=True, use_attribute_docstrings=True)

    role: Role
    content: Annotated[
        Union[Annotated[Text, Tag("string")], Annotated[list[TextPart], Field(min_length=1), Tag("array")]],
        _by_kind("expected a string or a non-empty list of text parts", "string", "array"),
    ]
    name: Text | None = None
    """Passed to the chat template."""
    tool_call_id: Text | None = None
    """Required on tool messages: the call this message answers."""
    tool_calls: Annotated[list[Any] | None, _unsupported([])] = None
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
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
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

    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, lt=2**31)] | None = None
    """0 or -1: off."""
    min_p: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] | None = None
    seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    logprobs: Annotated[int, Field(ge=0, le=1)] | None = None
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
    presence_penalty: Annotated[Any, _unsupported(0)] = None
    frequency_penalty: Annotated[Any, _unsupported(0)] = None
    repetition_penalty: Annotated[Any, _unsupported(1)] = None
    logit_bias: Annotated[Any, _unsupported(None)] = None
    ignore_eos: Annotated[Any, _unsupported(False)] = None
    min_tokens: Annotated[Any, _unsupported(0)] = None
    prompt_logprobs: Annotated[Any, _unsupported(None)] = None
    bad_words: Annotated[Any, _unsupported(None)] = None
    allowed_token_ids: Annotated[Any, _unsupported(None)] = None
    structured_outputs: Annotated[Any, _unsupported(None)] = None
    guided_decoding: Annotated[Any, _unsupported(None)] = None


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
    stream: Annotated[bool | None, _unsupported(False)] = None
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
