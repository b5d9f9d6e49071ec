"""OpenAI-style request parsing and response shaping, free of HTTP.

`parse_completion(body)` and `parse_chat(body)` turn a decoded JSON body into a `Call` (prompt
token ids or text, sampling parameters, n, stream) or raise `BadRequest` naming the field.
Every field is either honoured as the OpenAI API defines it or, when nonstop cannot honour it
(`top_logprobs` > 0, `echo`, penalties, `logit_bias`, tools, ...), rejected with a 400 naming
it: nothing is ignored silently. Text must be valid Unicode (no lone surrogates); chat
`content` may be a string or a list of text parts (joined with newlines).
Responses carry the OpenAI fields plus a `nonstop` extension per choice: `prompt_token_ids`,
`token_ids`, `logprobs` (behaviour logprobs), `policy_versions` and, when the request
truncated, `sampling_mask` (kept ids per token), so agent code round-trips tokens without
retokenising. `TextCutter` applies stop strings to text (the stop string is not returned, as in
the OpenAI API) and holds back, while streaming, the tail that might still become one.
"""

from __future__ import annotations

import json
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
    include_usage: bool = False
    """stream_options.include_usage: a last streamed chunk with the usage and no choices."""


SEED_RANGE = (-(2**63), 2**63 - 1)
"""Seeds torch's generator takes for every one of the n completions (seed + index)."""

UNSUPPORTED = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "suffix": "",
    "best_of": 1,
    "tools": [],
    "functions": [],
    "tool_choice": "none",
    "response_format": {"type": "text"},
    "echo": False,
    "parallel_tool_calls": None,
    "prediction": None,
    "audio": None,
    "modalities": ["text"],
}
"""OpenAI fields nonstop does not implement, with the value that means 'not used' (accepted)."""


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


def _unicode(v: str, key: str) -> str:
    """`v`, if it is valid Unicode (JSON lets a lone surrogate through; tokenizers refuse it)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{key}: not valid Unicode text ({e.reason} at character {e.start})", key) from None
    return v


def _unsupported(body: dict) -> None:
    for key, neutral in UNSUPPORTED.items():
        v = body.get(key)
        if v is not None and v != neutral and not (key == "best_of" and v == body.get("n", 1)):
            raise BadRequest(f"{key}: not supported by nonstop serve (send {json.dumps(neutral)} or leave it out)", key)


def _strings(body: dict, key: str) -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(x, str) for x in v) and len(v) <= 16:
        return [_unicode(x, key) for x in v if x]
    raise BadRequest(f"{key}: expected a string or a list of at most 16 strings", key)


def _token_ids(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in v):
        raise BadRequest(f"{key}: expected a list of non-negative token ids", key)
    return v


def _common(body: Any, max_tokens_default: int) -> tuple[SamplingParams, int, bool, str | None]:
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    _unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model: expected a string", "model")
    max_tokens = _number(body, "max_completion_tokens", None, int, 1) or _number(
        body, "max_tokens", max_tokens_default, int, 1
    )
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, float, 0.0, 100.0),
        seed=_number(body, "seed", None, int, *SEED_RANGE),
        top_k=_number(body, "top_k", 0, int, 0, 2**31 - 1),
        top_p=_number(body, "top_p", 1.0, float, 1e-9, 1.0),
        min_p=_number(body, "min_p", 0.0, float, 0.0, 0.999999),
        stop=_strings(body, "stop"),
        stop_token_ids=_token_ids(body.get("stop_token_ids", []), "stop_token_ids"),
    )
    n = _number(body, "n", 1, int, 1, 128)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: expected true or false", "stream")
    return params, n, stream, model


def _include_usage(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise BadRequest('stream_options: only allowed with "stream": true', "stream_options")
    if (
        not isinstance(opts, dict)
        or set(opts) - {"include_usage"}
        or not isinstance(opts.get("include_usage", False), bool)
    ):
        raise BadRequest('stream_options: expected {"include_usage": true|false}', "stream_options")
    return bool(opts.get("include_usage", False))


def _completion_logprobs(body: dict) -> bool:
    """Legacy completions: `logprobs` N asks for the N most likely alternatives too; nonstop
    returns the sampled token's behaviour logprob only, so N may be 0 or 1."""
    v = body.get("logprobs")
    if v is None or v is False:
        return False
    if v is True or (isinstance(v, int) and v in (0, 1)):
        return bool(v)
    raise BadRequest(
        f"logprobs: expected 0 or 1, got {v!r} (nonstop returns the sampled token's logprob only, not alternatives)",
        "logprobs",
    )


def _chat_logprobs(body: dict) -> bool:
    v, top = body.get("logprobs"), body.get("top_logprobs")
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"logprobs: expected true or false, got {v!r}", "logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise BadRequest(f"top_logprobs: expected a non-negative integer, got {top!r}", "top_logprobs")
    if top:
        raise BadRequest(
            "top_logprobs: not supported (nonstop returns the sampled token's behaviour logprob only; "
            "send 0 or leave it out)",
            "top_logprobs",
        )
    if top is not None and not v:
        raise BadRequest('top_logprobs: needs "logprobs": true', "top_logprobs")
    return bool(v)


def parse_completion(body: Any, max_tokens_default: int) -> Call:
    params, n, stream, model = _common(body, max_tokens_default)
    want, usage = _completion_logprobs(body), _include_usage(body, stream)
    prompt = body.get("prompt_token_ids", body.get("prompt"))
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest(f"prompt: one prompt per request (got {len(prompt)}); send one request per prompt", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt: empty", "prompt")
        return Call(model, None, _unicode(prompt, "prompt"), None, params, n, stream, want, usage)
    if isinstance(prompt, list) and prompt:
        return Call(model, _token_ids(prompt, "prompt"), None, None, params, n, stream, want, usage)
    raise BadRequest("prompt: expected a non-empty string or list of token ids", "prompt")


def _content(m: Any, i: int) -> str:
    """A message's text: a string, or a list of {type: text, text} parts joined with newlines."""
    key = f"messages[{i}].content"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"messages[{i}]: expected a {{role, content}} object with a string role", "messages")
    c = m.get("content")
    if isinstance(c, str):
        return _unicode(c, key)
    if isinstance(c, list) and c:
        for j, part in enumerate(c):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(
                    f'{key}[{j}]: expected a {{"type": "text", "text": ...}} part '
                    f"(got type {kind!r}; nonstop serves text only)",
                    "messages",
                )
        return _unicode("\n".join(part["text"] for part in c), key)
    raise BadRequest(f"{key}: expected a string or a non-empty list of text parts", "messages")


def parse_chat(body: Any, max_tokens_default: int) -> Call:
    params, n, stream, model = _common(body, max_tokens_default)
    want, usage = _chat_logprobs(body), _include_usage(body, stream)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects", "messages")
    msgs = []
    for i, m in enumerate(messages):
        content = _content(m, i)
        msgs.append({"role": _unicode(m["role"], f"messages[{i}].role"), "content": content})
    return Call(model, None, None, msgs, params, n, stream, want, usage)


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


def extension(sample: Sample) -> dict[str, Any]:
    ext: dict[str, Any] = {
        "prompt_token_ids": sample.prompt_ids,
        "token_ids": sample.completion_ids,
        "logprobs": sample.logprobs,
        "policy_versions": sample.versions,
    }
    if sample.sampling_mask is not None:
        ext["sampling_mask"] = [list(m) for m in sample.sampling_mask]
    return ext


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
