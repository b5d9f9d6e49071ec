"""The request shapes of `nonstop serve`, as pydantic models: one schema validates, documents, fuzzes.

`CompletionRequest` (`POST /v1/completions`), `ChatRequest` (`POST /v1/chat/completions`) and
`GenerateRequest` (vLLM's `POST /inference/v1/generate`) hold every field the server reads: the
OpenAI ones, nonstop's extensions (`top_k`, `min_p`, `stop_token_ids`, `prompt_token_ids`) and
the OpenAI fields nonstop cannot honour, which are accepted at their neutral value only (a 400
naming the field otherwise, never ignored). Their field types (serve/fields.py) are strict JSON
types with the bounds the engine can take; rules across fields (one prompt, `stream_options` only
when streaming, a `tool` message's `tool_call_id`) are validators here, and, where JSON Schema can
say them, the schema says them too. serve/validation.py turns a refusal into a 400 naming the
field; serve/openapi.py publishes the models' JSON schema at `/openapi.json`, which the fuzz tests
generate requests from.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from nonstop.serve.fields import (
    MinP,
    N,
    Positive,
    Seed,
    Stop,
    StopTokenIds,
    Temperature,
    Text,
    TokenId,
    TopK,
    TopP,
    Unsupported,
    Zero,
    ZeroOrOne,
    by_kind,
    prompt_kind,
    short,
    zero_or_one,
)


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
                prompt_kind,
                custom_error_type="expected",
                custom_error_message="expected a non-empty string or list of token ids",
            ),
        ]
        | None
    ) = None
    """Text, or token ids; a list holding one of either is a batch of one (one prompt per request)."""
    prompt_token_ids: Annotated[list[TokenId], Field(json_schema_extra={"minItems": 1})] | None = None
    """nonstop extension: the prompt as token ids (instead of prompt)."""
    logprobs: ZeroOrOne | None = None
    """0 or 1: the sampled tokens' behaviour logprobs, as OpenAI's legacy `logprobs` N (the sampled
    token plus N alternatives; nonstop has none to return, so 0 and 1 answer alike). An integer, as
    the API defines it: `true` is refused as every boolean sent for an integer is (chat's
    `logprobs` is the boolean one)."""

    _no_alternatives = field_validator("logprobs", mode="before")(lambda v: zero_or_one(v))

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
            "text_only", 'expected "text" (got {got}; nonstop serves text only)', {"got": short(v)}
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
        by_kind("expected a string or a non-empty list of text parts", "string", "array"),
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
    top_logprobs: Zero | None = None
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
    _no_alternatives = field_validator("logprobs", mode="before")(lambda v: zero_or_one(v))
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
