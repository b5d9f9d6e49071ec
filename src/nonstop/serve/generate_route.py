"""vLLM's token-level `POST /inference/v1/generate`: token ids in, token ids and logprobs out.

This is the endpoint the `verifiers` (0.4.0, `verifiers.v1`) train client and prime-rl call
through `renderers.client.generate`: the client renders the chat itself (keeping earlier turns'
ids as they are) and sends only ids, so no text crosses the wire in either direction.

Request: `{"model", "token_ids": [...], "sampling_params": {...}, "request_id"?, "cache_salt"?,
"priority"?}`. `sampling_params` takes vLLM's names: `max_tokens`, `temperature`, `top_p`,
`top_k` (0 or -1: off), `min_p`, `seed`, `n`, `stop`, `stop_token_ids`, `logprobs` (0 or 1: the
sampled token's behaviour logprob; nonstop has no alternatives to return). Keys that only shape
text or caches (`skip_special_tokens`, `spaces_between_special_tokens`, `detokenize`,
`include_stop_str_in_output`, `routed_experts_prompt_start`, `return_sampling_mask`) are
accepted; penalties, `logit_bias`, `ignore_eos`, `min_tokens` only at their neutral value; any
other key is a 400 naming `sampling_params.<key>`, as in the OpenAI routes (nothing is ignored
silently). `cache_salt` and `priority` are accepted (the built-in engine has neither a shared
prefix cache to salt nor priorities); `stream`, `features` and `content_parts` are refused (text
tokens only, one JSON answer).

Response: `{"request_id", "prompt_token_ids", "choices": [{"index", "token_ids", "logprobs":
{"content": [{"token": "token_id:<id>", "logprob"}]}, "finish_reason", "sampling_mask"?,
"nonstop"}], "usage"}` -- vLLM's shape, whose `logprobs.content[i].token` names the sampled id
as `renderers` checks it; `sampling_mask` (kept ids per token) when the sampling truncated, as
vLLM's `--return-sampling-mask` gives it; `nonstop` is the extension the OpenAI routes carry
(token ids, behaviour logprobs, `policy_versions`), which vLLM clients ignore and nonstop's
adapters read (envs/verifiers_env.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from nonstop.serve.protocol import SEED_RANGE, BadRequest, Call, _number, _strings, _token_ids, extension
from nonstop.types import Sample, SamplingParams

PATH = "/inference/v1/generate"

_FREE_KEYS = {
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
    "include_stop_str_in_output",
    "routed_experts_prompt_start",
    "return_sampling_mask",
}
"""sampling_params keys that change neither the tokens sampled nor their logprobs."""
_NEUTRAL = {
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": None,
    "ignore_eos": False,
    "min_tokens": 0,
    "prompt_logprobs": None,
    "bad_words": None,
    "allowed_token_ids": None,
    "structured_outputs": None,
    "guided_decoding": None,
}
"""Keys nonstop does not implement, with the value that means 'not used' (accepted)."""
_SAMPLING = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids", "logprobs"}
_BODY = {"model", "token_ids", "sampling_params", "request_id", "cache_salt", "priority", "stream"}


@dataclass
class GenerateCall:
    call: Call
    request_id: str


def parse_generate(body: Any, max_tokens_default: int) -> GenerateCall:
    """A validated `/inference/v1/generate` body, or `BadRequest` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("request body: expected a JSON object")
    for key in body:
        if key not in _BODY:
            raise BadRequest(f"{key}: not supported by nonstop's /inference/v1/generate (text token ids only)", key)
    if body.get("stream", False) is not False:
        raise BadRequest("stream: not supported on /inference/v1/generate (send false or leave it out)", "stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("model: expected a string", "model")
    prompt = _token_ids(body.get("token_ids"), "token_ids")
    if not prompt:
        raise BadRequest("token_ids: empty", "token_ids")
    sp = body.get("sampling_params", {}) or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params: expected an object", "sampling_params")
    for key, value in sp.items():
        if key in _SAMPLING or key in _FREE_KEYS:
            continue
        if key in _NEUTRAL and value in (_NEUTRAL[key], None):
            continue
        raise BadRequest(
            f"sampling_params.{key}: not supported by nonstop (send {_NEUTRAL.get(key)!r} or leave it out)"
            if key in _NEUTRAL
            else f"sampling_params.{key}: unknown sampling parameter",
            f"sampling_params.{key}",
        )
    top_k = _number(sp, "top_k", 0, int, -1, 2**31 - 1)
    params = SamplingParams(
        max_new_tokens=_number(sp, "max_tokens", max_tokens_default, int, 1),
        temperature=_number(sp, "temperature", 1.0, float, 0.0, 100.0),
        seed=_number(sp, "seed", None, int, *SEED_RANGE),
        top_k=max(top_k, 0),  # vLLM's -1 and nonstop's 0 both mean off
        top_p=_number(sp, "top_p", 1.0, float, 1e-9, 1.0),
        min_p=_number(sp, "min_p", 0.0, float, 0.0, 0.999999),
        stop=_strings(sp, "stop"),
        stop_token_ids=_token_ids(sp.get("stop_token_ids") or [], "sampling_params.stop_token_ids"),
    )
    logprobs = sp.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or logprobs not in (0, 1)):
        raise BadRequest(
            f"sampling_params.logprobs: expected 0 or 1, got {logprobs!r} (nonstop returns the sampled "
            "token's behaviour logprob only, not alternatives)",
            "sampling_params.logprobs",
        )
    n = _number(sp, "n", 1, int, 1, 128)
    rid = body.get("request_id") or f"gen-{uuid.uuid4().hex[:24]}"
    if not isinstance(rid, str):
        raise BadRequest("request_id: expected a string", "request_id")
    return GenerateCall(Call(model, prompt, None, None, params, n, False, logprobs is not None), rid)


def generate_response(g: GenerateCall, samples: list[Sample]) -> dict[str, Any]:
    """vLLM's answer for the samples of one request, with the `nonstop` extension per choice."""
    choices = []
    for i, s in enumerate(samples):
        choice: dict[str, Any] = {
            "index": i,
            "token_ids": list(s.completion_ids),
            "finish_reason": s.finish_reason,
            "nonstop": extension(s),
        }
        if g.call.want_logprobs:
            choice["logprobs"] = {
                "content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(s.completion_ids, s.logprobs)]
            }
        if s.sampling_mask is not None:
            choice["sampling_mask"] = [list(m) for m in s.sampling_mask]
        choices.append(choice)
    prompt = g.call.prompt_ids or []
    completion = sum(len(s.completion_ids) for s in samples)
    return {
        "request_id": g.request_id,
        "prompt_token_ids": list(prompt),
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        },
    }
