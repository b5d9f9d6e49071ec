"""The response shapes of `nonstop serve`, as pydantic models: the server builds every answer from
them, and serve/openapi.py publishes their JSON schema at `/openapi.json`.

OpenAI's shapes, plus the `nonstop` extension on every choice (`NonstopExtension`: the engine's
token ids, behaviour logprobs, policy_version of each token and, when sampling truncated, the
kept ids per token), which OpenAI clients ignore and nonstop's clients read. A field with no
value is left out of the JSON (a choice's `logprobs` when none were asked for), as the OpenAI API
leaves it out, except `finish_reason` and an error's `param`, which are null until they apply.
Errors, on every route: `ErrorResponse`, `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

FinishReason = Literal["stop", "length"]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    KEEP_NULL: ClassVar[frozenset[str]] = frozenset({"finish_reason", "param"})

    # no return annotation: pydantic would take it for the serialised schema and document {}
    @model_serializer(mode="wrap")
    def _leave_out_nulls(self, handler: SerializerFunctionWrapHandler):
        return {k: v for k, v in handler(self).items() if v is not None or k in self.KEEP_NULL}

    def json_object(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ErrorDetail(_Shape):
    message: str
    type: Literal[
        "invalid_request_error",
        "authentication_error",
        "not_found_error",
        "conflict_error",
        "rate_limit_error",
        "server_error",
    ]
    """invalid_request_error (other 4xx), authentication_error (401), not_found_error (404), conflict_error (409),
    rate_limit_error (429), server_error (5xx)."""
    param: str | None
    """The field at fault, when there is one (a path's leading names: `messages`, `sampling_params.top_k`)."""
    code: int
    """The HTTP status."""


class ErrorResponse(_Shape):
    error: ErrorDetail


class Usage(_Shape):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class NonstopExtension(_Shape):
    """What nonstop adds to every choice, so agent code never retokenises."""

    prompt_token_ids: list[int] | None = None
    """The prompt as the engine saw it (absent on a streamed token's chunk)."""
    token_ids: list[int]
    """The completion's tokens as sampled (on a streamed token's chunk: that token)."""
    logprobs: list[float]
    """Behaviour logprob of each token, under the distribution it was sampled from."""
    policy_versions: list[int]
    """policy_version of the weights that produced each token."""
    sampling_mask: list[list[int]] | None = None
    """When the sampling truncated (top_k, top_p, min_p): the token ids kept at each position."""


class CompletionLogprobs(_Shape):
    """Legacy completions logprobs. nonstop has no alternatives: `top_logprobs[i]` holds the
    sampled token only, and `text_offset[i]` is where token i's text starts in the completion."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatTokenLogprob(_Shape):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]]
    """Always empty: nonstop has no alternatives."""


class ChatLogprobs(_Shape):
    content: list[ChatTokenLogprob]


class CompletionChoice(_Shape):
    index: int
    text: str
    finish_reason: FinishReason | None
    """null on every streamed chunk but a choice's last."""
    logprobs: CompletionLogprobs | None = None
    nonstop: NonstopExtension


class CompletionResponse(_Shape):
    """`POST /v1/completions`; streamed, each server-sent event is one of these (with `usage` only
    on the last, and only with stream_options.include_usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Shape):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Shape):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChatLogprobs | None = None
    nonstop: NonstopExtension


class ChatCompletionResponse(_Shape):
    """`POST /v1/chat/completions`."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Shape):
    role: Literal["assistant"] | None = None
    """On each choice's first chunk."""
    content: str


class ChatChunkChoice(_Shape):
    index: int
    delta: ChatDelta
    finish_reason: FinishReason | None
    logprobs: ChatLogprobs | None = None
    nonstop: NonstopExtension


class ChatCompletionChunk(_Shape):
    """One server-sent event of a streamed `POST /v1/chat/completions`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class GenerateTokenLogprob(_Shape):
    token: str
    """`token_id:<id>`, as vLLM names the sampled id."""
    logprob: float


class GenerateLogprobs(_Shape):
    content: list[GenerateTokenLogprob]


class GenerateChoice(_Shape):
    index: int
    token_ids: list[int]
    logprobs: GenerateLogprobs | None = None
    finish_reason: FinishReason
    sampling_mask: list[list[int]] | None = None
    nonstop: NonstopExtension


class GenerateResponse(_Shape):
    """vLLM's answer to `POST /inference/v1/generate`."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[GenerateChoice]
    usage: Usage


class Health(_Shape):
    """`GET /health`: answers whatever the engine is doing."""

    status: Literal["ok"] = "ok"
    model: str
    policy_version: int
    """Of the weights being served: a checkpoint's own version, counted on by weight updates."""
    running: int
    waiting: int


class ModelCard(_Shape):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "nonstop"
    max_model_len: int
    """vLLM's extension, read by renderers: the engine's max_seq_len."""


class ModelList(_Shape):
    object: Literal["list"] = "list"
    data: list[ModelCard]
