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
adapters read (envs/verifiers/env.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from nonstop.serve.protocol import Call, extension
from nonstop.serve.responses import GenerateChoice, GenerateLogprobs, GenerateResponse, GenerateTokenLogprob, Usage
from nonstop.serve.schema import GenerateRequest, GenerateSamplingParams
from nonstop.serve.validation import validate
from nonstop.types import Sample, SamplingParams

PATH = "/inference/v1/generate"


@dataclass
class GenerateCall:
    call: Call
    request_id: str


def parse_generate(body: Any, max_tokens_default: int) -> GenerateCall:
    """A validated `/inference/v1/generate` body (schema.GenerateRequest), or `BadRequest` naming the field."""
    r = validate(GenerateRequest, body)
    sp = r.sampling_params or GenerateSamplingParams()
    stop = [sp.stop] if isinstance(sp.stop, str) else sp.stop or []
    params = SamplingParams(
        max_new_tokens=sp.max_tokens or max_tokens_default,
        temperature=1.0 if sp.temperature is None else sp.temperature,
        seed=sp.seed,
        top_k=max(sp.top_k or 0, 0),  # vLLM's -1 and nonstop's 0 both mean off
        top_p=1.0 if sp.top_p is None else sp.top_p,
        min_p=sp.min_p or 0.0,
        stop=[s for s in stop if s],
        stop_token_ids=list(sp.stop_token_ids or []),
    )
    n, want = sp.n or 1, sp.logprobs is not None
    rid = r.request_id or f"gen-{uuid.uuid4().hex[:24]}"
    return GenerateCall(Call(r.model, list(r.token_ids), None, None, params, n, False, want), rid)


def generate_response(g: GenerateCall, samples: list[Sample]) -> dict[str, Any]:
    """vLLM's answer for the samples of one request, with the `nonstop` extension per choice."""
    choices = []
    for i, s in enumerate(samples):
        logprobs = (
            GenerateLogprobs(
                content=[
                    GenerateTokenLogprob(token=f"token_id:{t}", logprob=lp)
                    for t, lp in zip(s.completion_ids, s.logprobs)
                ]
            )
            if g.call.want_logprobs
            else None
        )
        choices.append(
            GenerateChoice(
                index=i,
                token_ids=list(s.completion_ids),
                logprobs=logprobs,
                finish_reason=s.finish_reason,
                sampling_mask=None if s.sampling_mask is None else [list(m) for m in s.sampling_mask],
                nonstop=extension(s),
            )
        )
    prompt = list(g.call.prompt_ids or [])
    completion = sum(len(s.completion_ids) for s in samples)
    usage = Usage(prompt_tokens=len(prompt), completion_tokens=completion, total_tokens=len(prompt) + completion)
    answer = GenerateResponse(request_id=g.request_id, prompt_token_ids=prompt, choices=choices, usage=usage)
    return answer.json_object()
