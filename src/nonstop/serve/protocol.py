"""OpenAI-style request parsing and response shaping, free of HTTP.

`parse_completion(body)` and `parse_chat(body)` turn a decoded JSON body into a `Call` (prompt
token ids or text, sampling parameters, n, stream) or raise `BadRequest` naming the field.
Responses carry the OpenAI fields plus a `nonstop` extension per choice: `prompt_token_ids`,
`token_ids`, `logprobs` (behaviour logprobs), `policy_versions` and, when the request
truncated, `sampling_mask` (kept ids per token), so agent code round-trips tokens without
retokenising. `TextCutter` applies stop strings to text (the stop string is not returned, as in
the OpenAI API) and holds back, while streaming, the tail that might still become one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nonstop.types import Sample, SamplingParams


class BadRequest(ValueError):
    """A request the server rejects with 400 (or `status`); the message names the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


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


def _number(body: dict, key: str, default: Any, kind: type, lo: float | None = None, hi: float | None = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"{key}: expected an integer, got {v!r}", key)
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
        raise BadRequest(f"{key}: expected a number, got {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"{key}: {v!r} is out of range [{lo}, {hi}]", key)
    return kind(v)


def _strings(body: dict, key: str) -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(x, str) for x in v) and len(v) <= 16:
        return [x for x in v if x]
    raise BadRequest(f"{key}: expected a string or a list of at most 16 strings", key)


def _token_ids(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise BadRequest(f"{key}: expected a list of non-negative token ids", key)
    return v


def _common(body: Any, max_tokens_default: int) -> tuple[SamplingParams, int, bool, bool, str | None]:
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model: expected a string", "model")
    max_tokens = _number(body, "max_completion_tokens", None, int, 1) or _number(body, "max_tokens", max_tokens_default, int, 1)
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, float, 0.0, 100.0),
        seed=_number(body, "seed", None, int),
        top_k=_number(body, "top_k", 0, int, 0),
        top_p=_number(body, "top_p", 1.0, float, 1e-9, 1.0),
        min_p=_number(body, "min_p", 0.0, float, 0.0, 0.999999),
        stop=_strings(body, "stop"),
        stop_token_ids=_token_ids(body.get("stop_token_ids", []), "stop_token_ids"),
    )
    n = _number(body, "n", 1, int, 1, 128)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected true or false", "stream")
    logprobs = body.get("logprobs")
    want = bool(logprobs) if isinstance(logprobs, (bool, int)) or logprobs is None else None
    if want is None:
        raise BadRequest("logprobs: expected a boolean or an integer", "logprobs")
    return params, n, stream, want, model


def parse_completion(body: Any, max_tokens_default: int) -> Call:
    params, n, stream, want, model = _common(body, max_tokens_default)
    prompt = body.get("prompt_token_ids", body.get("prompt"))
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt: empty", "prompt")
        return Call(model, None, prompt, None, params, n, stream, want)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return Call(model, None, prompt, None, params, n, stream, want)
    if isinstance(prompt, list) and prompt:
        return Call(model, _token_ids(prompt, "prompt"), None, None, params, n, stream, want)
    raise BadRequest("prompt: expected a non-empty string or list of token ids (one prompt per request)", "prompt")


def parse_chat(body: Any, max_tokens_default: int) -> Call:
    params, n, stream, want, model = _common(body, max_tokens_default)
    messages = body.get("messages")
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects with string content", "messages")
    return Call(model, None, None, [{"role": m["role"], "content": m["content"]} for m in messages], params, n, stream, want)


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
        piece, self.sent = text[self.sent:end], end
        return piece


def extension(sample: Sample) -> dict[str, Any]:
    ext: dict[str, Any] = {
        "prompt_token_ids": sample.prompt_ids, "token_ids": sample.completion_ids,
        "logprobs": sample.logprobs, "policy_versions": sample.versions,
    }
    if sample.sampling_mask is not None:
        ext["sampling_mask"] = [list(m) for m in sample.sampling_mask]
    return ext


def sample_from_extension(ext: dict[str, Any], finish_reason: str) -> Sample:
    return Sample(prompt_ids=ext["prompt_token_ids"], completion_ids=ext["token_ids"], logprobs=ext["logprobs"],
                  # a str from JSON: nonstop's server only ever sends 'stop' or 'length'
                  versions=ext["policy_versions"], finish_reason=finish_reason,  # type: ignore[arg-type]
                  sampling_mask=ext.get("sampling_mask"))
