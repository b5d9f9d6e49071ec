"""OpenAI-style requests as engine calls, free of HTTP.

`parse_completion(body)` and `parse_chat(body)` validate a decoded JSON body against the request
models of serve/schema.py (the schema `/openapi.json` publishes) and turn it into a `Call`
(prompt token ids or text, sampling parameters, n, stream), or raise `BadRequest` naming the
field. Every field is either honoured as the OpenAI API defines it or, when nonstop cannot honour
it (`top_logprobs` > 0, `echo`, penalties, `logit_bias`, tools, ...), refused with a 400 naming
it; a field the schema does not know is kept in `Call.unknown` for the server to log.
`extension(sample)` is the `nonstop` extension of a choice (serve/responses.py
`NonstopExtension`: prompt and completion token ids, behaviour logprobs, policy versions and,
when the request truncated, the kept ids per token), so agent code round-trips tokens without
retokenising; `sample_from_extension` reads it back. `TextCutter` applies stop strings to text
(the stop string is not returned, as in the OpenAI API) and holds back, while streaming, the tail
that might still become one. `ServedEngine` is the engine side of the protocol: what the server
asks of an engine, built-in or vLLM.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from nonstop.engine.aio import TokenEvent
from nonstop.serve.fields import SEED_RANGE
from nonstop.serve.responses import NonstopExtension
from nonstop.serve.schema import ChatRequest, CompletionRequest, SamplingFields
from nonstop.serve.validation import BadRequest, validate
from nonstop.types import GenerationRequest, Sample, SamplingParams

__all__ = [
    "SEED_RANGE",
    "BadRequest",
    "Call",
    "ServedEngine",
    "TextCutter",
    "extension",
    "parse_chat",
    "parse_completion",
]


@dataclass
class Call:
    model: str | None
    prompt_ids: list[int] | None
    prompt_text: str | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    n: int
    stream: bool
    want_logprobs: bool
    include_usage: bool = False
    """stream_options.include_usage: a last streamed chunk with the usage and no choices."""
    unknown: tuple[str, ...] = ()
    """Fields of the body the server does not know (accepted, and logged by the server)."""


def _params(r: SamplingFields, max_tokens_default: int) -> SamplingParams:
    stop = r.stop if isinstance(r.stop, list) else [r.stop] if r.stop is not None else []
    return SamplingParams(
        max_new_tokens=r.max_completion_tokens or r.max_tokens or max_tokens_default,
        temperature=1.0 if r.temperature is None else r.temperature,
        seed=r.seed,
        top_k=max(r.top_k or 0, 0),  # vLLM's -1 and nonstop's 0 both mean off
        top_p=1.0 if r.top_p is None else r.top_p,
        min_p=r.min_p or 0.0,
        stop=[s for s in stop if s],
        stop_token_ids=list(r.stop_token_ids or []),
    )


def _unknown(r: BaseModel, *nested: BaseModel) -> tuple[str, ...]:
    return tuple(sorted({*(r.model_extra or {}), *(k for m in nested for k in (m.model_extra or {}))}))


def _call(r: SamplingFields, max_tokens_default: int, want_logprobs: bool, **prompt: Any) -> Call:
    opts = r.stream_options
    return Call(
        model=r.model,
        params=_params(r, max_tokens_default),
        n=r.n or 1,
        stream=bool(r.stream),
        want_logprobs=want_logprobs,
        include_usage=opts is not None and opts.include_usage,
        **prompt,
    )


def parse_completion(body: Any, max_tokens_default: int) -> Call:
    """A validated `/v1/completions` body (schema.CompletionRequest), or BadRequest naming the field."""
    r = validate(CompletionRequest, body)
    p = r.the_prompt
    return _call(
        r,
        max_tokens_default,
        r.logprobs is not None,  # 0 asks for the sampled tokens' logprobs, with no alternatives
        prompt_ids=p if isinstance(p, list) else None,
        prompt_text=p if isinstance(p, str) else None,
        messages=None,
        unknown=_unknown(r),
    )


def parse_chat(body: Any, max_tokens_default: int) -> Call:
    """A validated `/v1/chat/completions` body (schema.ChatRequest), or BadRequest naming the field.
    Each message goes to the chat template as role and text (text parts joined with newlines),
    with its name and tool_call_id when given."""
    r = validate(ChatRequest, body)
    msgs = []
    for m in r.messages:
        msg = {"role": m.role, "content": m.text}
        msg.update({k: v for k, v in (("name", m.name), ("tool_call_id", m.tool_call_id)) if v is not None})
        msgs.append(msg)
    return _call(
        r,
        max_tokens_default,
        bool(r.logprobs),
        prompt_ids=None,
        prompt_text=None,
        messages=msgs,
        unknown=_unknown(r, *r.messages),
    )


class TextCutter:
    """Text of a growing completion with stop strings applied."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def final(self, text: str) -> str:
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=len(text))
        return text[:cut]

    def delta(self, text: str, finished: bool) -> str:
        """The next piece to stream: new text, minus a tail that could still start a stop string."""
        text = self.final(text)
        end = len(text) if finished else max(self.sent, len(text) - self.hold)
        piece, self.sent = text[self.sent : end], end
        return piece


def extension(sample: Sample) -> NonstopExtension:
    """The `nonstop` extension of a finished choice: its prompt and completion tokens, behaviour
    logprobs, policy versions and, when the sampling truncated, the kept ids per token."""
    return NonstopExtension(
        prompt_token_ids=list(sample.prompt_ids),
        token_ids=list(sample.completion_ids),
        logprobs=list(sample.logprobs),
        policy_versions=list(sample.versions),
        sampling_mask=None if sample.sampling_mask is None else [list(m) for m in sample.sampling_mask],
    )


def sample_from_extension(ext: dict[str, Any], finish_reason: str) -> Sample:
    return Sample(
        prompt_ids=ext["prompt_token_ids"],
        completion_ids=ext["token_ids"],
        logprobs=ext["logprobs"],
        # a str from JSON: nonstop's server only ever sends 'stop' or 'length'
        versions=ext["policy_versions"],
        finish_reason=finish_reason,  # type: ignore[arg-type]
        sampling_mask=ext.get("sampling_mask"),
    )


class ServedEngine(Protocol):
    """What the server asks of an engine (implemented by engine/aio.py AsyncEngine and
    engine/vllm/engine.py VllmEngineWorker)."""

    @property
    def max_seq_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def check(self, request: GenerationRequest) -> None:
        """Raise RequestError (a 400 naming the field) for a request the engine cannot take."""

    def submit(self, request: GenerationRequest, queue: asyncio.Queue | None = None) -> asyncio.Future:
        """A future of the request's n samples; cancelling it aborts the request."""

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | list[Sample]]: ...

    def health(self) -> dict[str, int]:
        """policy_version, running and waiting sequences."""

    async def close(self) -> None: ...
