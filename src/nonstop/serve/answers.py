"""How the server answers a validated request: the engine's samples written as OpenAI responses,
whole or streamed as server-sent events, with their logprobs, usage and the `nonstop` extension.

`Answers` is a mixin of serve/server.py's `EngineServer`, which validates the request (routes,
limits, `_request`) and holds the attributes declared below; a recorded episode's turn is ended
here, once its sample is known, before the client can send the next turn.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from nonstop.engine.aio import TokenEvent
from nonstop.serve import responses as r
from nonstop.serve.episode_record import Turn
from nonstop.serve.protocol import Call, ServedEngine, TextCutter, extension
from nonstop.serve.recorder import EpisodeRecorder
from nonstop.types import FinishReason, GenerationRequest


class Answers:
    # set by EngineServer (serve/server.py); declared here for the type checker only
    engine: ServedEngine
    tokenizer: Any
    model_name: str
    recorder: EpisodeRecorder | None
    requests_served: int
    _request: Callable[[Call, list[int], str], GenerationRequest]

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _serve(
        self, request: web.Request, call: Call, prompt_ids: list[int], chat: bool, turn: Turn | None = None
    ) -> web.StreamResponse:
        req = self._request(call, prompt_ids, "messages" if chat else "prompt")
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if call.stream:
            return await self._stream(request, call, req, rid, chat, turn)
        samples = await self.engine.submit(req)
        self.requests_served += 1
        if turn is not None and self.recorder is not None:
            self.recorder.end_turn(
                turn, samples[0], TextCutter(call.params.stop).final(self._text(samples[0].completion_ids))
            )
        usage = _usage(len(prompt_ids), sum(len(s.completion_ids) for s in samples))
        created, cut = int(time.time()), TextCutter(call.params.stop)
        out: r.ChatCompletionResponse | r.CompletionResponse
        if chat:
            choices = [
                r.ChatChoice(
                    index=i,
                    message=r.AssistantMessage(content=cut.final(self._text(s.completion_ids))),
                    finish_reason=s.finish_reason,
                    logprobs=self._chat_logprobs(s.completion_ids, s.logprobs) if call.want_logprobs else None,
                    nonstop=extension(s),
                )
                for i, s in enumerate(samples)
            ]
            out = r.ChatCompletionResponse(id=rid, created=created, model=self.model_name, choices=choices, usage=usage)
        else:
            texts = [
                r.CompletionChoice(
                    index=i,
                    text=cut.final(self._text(s.completion_ids)),
                    finish_reason=s.finish_reason,
                    logprobs=self._completion_logprobs(s.completion_ids, s.logprobs) if call.want_logprobs else None,
                    nonstop=extension(s),
                )
                for i, s in enumerate(samples)
            ]
            out = r.CompletionResponse(id=rid, created=created, model=self.model_name, choices=texts, usage=usage)
        return web.json_response(out.json_object())

    def _chat_logprobs(self, ids: list[int], logprobs: list[float]) -> r.ChatLogprobs:
        """The sampled tokens' behaviour logprobs in the chat shape (no alternatives)."""
        return r.ChatLogprobs(
            content=[
                r.ChatTokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8", "replace")), top_logprobs=[])
                for t, lp in zip(self._tokens(ids), logprobs)
            ]
        )

    def _completion_logprobs(self, ids: list[int], logprobs: list[float], offset: int = 0) -> r.CompletionLogprobs:
        """The legacy completions shape: each token's text, behaviour logprob, the sampled token as its
        only 'top' entry, and where its text starts (`offset`: the characters streamed before it)."""
        tokens = self._tokens(ids)
        return r.CompletionLogprobs(
            tokens=tokens,
            token_logprobs=logprobs,
            top_logprobs=[{t: lp} for t, lp in zip(tokens, logprobs)],
            text_offset=list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset)) if tokens else [],
        )

    def _tokens(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    async def _stream(
        self, request: web.Request, call: Call, req: GenerationRequest, rid: str, chat: bool, turn: Turn | None = None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        created = int(time.time())
        ids: list[list[int]] = [[] for _ in range(req.n)]
        cutters = [TextCutter(call.params.stop) for _ in range(req.n)]
        offsets = [0] * req.n  # characters of token text sent so far, per choice (text_offset)
        started = [False] * req.n  # a chat choice's first chunk carries role: assistant

        async def send(index: int, text: str, finish: FinishReason | None, ext: r.NonstopExtension) -> None:
            chunk: r.ChatCompletionChunk | r.CompletionResponse
            want = call.want_logprobs and finish is None
            if chat:
                delta = r.ChatDelta(role=None if started[index] else "assistant", content=text)
                started[index] = True
                lp = self._chat_logprobs(ext.token_ids, ext.logprobs) if want else None
                choice = r.ChatChunkChoice(index=index, delta=delta, finish_reason=finish, logprobs=lp, nonstop=ext)
                chunk = r.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[choice])
            else:
                clp = self._completion_logprobs(ext.token_ids, ext.logprobs, offsets[index]) if want else None
                offsets[index] += sum(len(t) for t in clp.tokens) if clp is not None else 0
                piece = r.CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=clp, nonstop=ext)
                chunk = r.CompletionResponse(id=rid, created=created, model=self.model_name, choices=[piece])
            await resp.write(f"data: {json.dumps(chunk.json_object())}\n\n".encode())

        completion_tokens = 0
        async for item in self.engine.stream(req):
            if isinstance(item, TokenEvent):
                ids[item.index].append(item.token_id)
                text = cutters[item.index].delta(self._text(ids[item.index]), finished=False)
                one = r.NonstopExtension(
                    token_ids=[item.token_id], logprobs=[item.logprob], policy_versions=[item.policy_version]
                )
                await send(item.index, text, None, one)
                continue
            for i, s in enumerate(item):
                completion_tokens += len(s.completion_ids)
                full = self._text(s.completion_ids)
                if turn is not None and self.recorder is not None:  # recorded before the client can send the next turn
                    self.recorder.end_turn(turn, s, cutters[i].final(full))
                text = cutters[i].delta(full, finished=True)
                await send(i, text, s.finish_reason, extension(s))
        if call.include_usage:
            usage = _usage(len(req.prompt_ids), completion_tokens)
            last: r.ChatCompletionChunk | r.CompletionResponse = (
                r.ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=[], usage=usage)
                if chat
                else r.CompletionResponse(id=rid, created=created, model=self.model_name, choices=[], usage=usage)
            )
            await resp.write(f"data: {json.dumps(last.json_object())}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.requests_served += 1
        return resp


def _usage(prompt_tokens: int, completion_tokens: int) -> r.Usage:
    return r.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, total_tokens=prompt_tokens + completion_tokens
    )
