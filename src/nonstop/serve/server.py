"""OpenAI-compatible HTTP server over the engine (aiohttp): token-in, token-out.

The engine is any `ServedEngine`: the built-in engine's AsyncEngine (engine.kind builtin) or
the vLLM engine (engine/vllm_engine.py VllmEngineWorker, engine.kind vllm); the routes, the
validation and the response shapes are the same for both.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions` (prompt as text or token ids),
`POST /v1/chat/completions` (messages through the tokenizer's chat template, or a plain
built-in one when the tokenizer has none), and vLLM's token-level `POST /inference/v1/generate`
(serve/generate_route.py: what verifiers' train client calls); the first two stream as server-sent events with
`"stream": true`. Every choice carries the `nonstop` extension (engine token ids, behaviour
logprobs, policy versions, Keep Sampling Mask; serve/protocol.py).

Contract: binds 127.0.0.1 unless told otherwise; with an API key, `/v1/*` and `/inference/*` need
`Authorization: Bearer <key>` (401 otherwise). Malformed or too deeply nested JSON or a bad
field -> 400 naming it; a prompt over the engine's limits -> 400 naming the limit, decided from
the text's length before tokenising when the text cannot fit, and tokenised off the event loop
otherwise (so `/health` answers while a large prompt is read); a body over 8 MiB -> 413; a wrong
method -> 405; an unknown model or route -> 404; anything unexpected -> 500 for that request
only. Errors are JSON `{"error": {"message", "type", "param", "code"}}`, typed as OpenAI types
them. A request never reaches the engine before it is fully validated, and a client that
disconnects (streamed or not) has its sequences aborted and gets one log line, so no bad or
abandoned request can take the engine down. `start()` raises `ServeError` with a plain message
when the address cannot be bound.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiohttp import web

from nonstop.engine.aio import TokenEvent
from nonstop.engine.scheduler import RequestError
from nonstop.serve import generate_route
from nonstop.serve.protocol import BadRequest, Call, TextCutter, extension, parse_chat, parse_completion
from nonstop.types import GenerationRequest, Sample

log = logging.getLogger("nonstop.serve")

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class ServedEngine(Protocol):
    """What the server asks of an engine (implemented by engine/aio.py AsyncEngine and
    engine/vllm_engine.py VllmEngineWorker)."""

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


class ServeError(RuntimeError):
    """The server cannot start (address in use, port out of range); the message says which."""


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status
    )


class EngineServer:
    def __init__(
        self,
        engine: ServedEngine,
        tokenizer: Any,
        model_name: str,
        api_key: str | None = None,
        max_tokens_default: int = 16,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.api_key, self.max_tokens_default = api_key, max_tokens_default
        self.chat_template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
        self._ids = itertools.count()
        self._runner: web.AppRunner | None = None
        # a text prompt of more characters than this cannot fit in max_seq_len tokens whatever the
        # tokenizer does (its longest token, with a margin for Unicode normalisation)
        self._chars_per_token = 4 * max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.requests_served = 0
        self.requests_failed = 0
        self.requests_disconnected = 0

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=8 * 2**20)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post(generate_route.PATH, self.generate)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve in the running loop; returns the bound port (port 0 picks a free one)."""
        if not 0 <= port <= 65535:
            raise ServeError(f"port {port}: expected 0 (any free port) to 65535")
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its sequences
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await self.stop()
            raise ServeError(
                f"cannot listen on {host}:{port}: {e.strerror or e} (choose another --port, or 0 for any free one)"
            ) from None
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        if self.api_key is not None and request.path.startswith(("/v1/", "/inference/")):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            self.requests_disconnected += 1
            log.info("client disconnected from %s %s; its generation was aborted", request.method, request.path)
            raise asyncio.CancelledError from None
        except BadRequest as e:
            self.requests_failed += 1
            return _error(e.status, str(e), e.param)
        except RequestError as e:
            self.requests_failed += 1
            return _error(400, str(e))
        except web.HTTPException as e:
            return _error(e.status, f"{request.method} {request.path}: {e.reason}")
        except Exception as e:  # one request fails, the server and the engine go on
            self.requests_failed += 1
            log.exception("request %s %s failed", request.method, request.path)
            return _error(500, f"internal error: {type(e).__name__}: {e}")

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": self.model_name, **self.engine.health()})

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "owned_by": "nonstop",
            "max_model_len": self.engine.max_seq_len,
        }  # vLLM's extension, read by renderers
        return web.json_response({"object": "list", "data": [card]})

    async def _body(self, request: web.Request) -> Any:
        try:
            return json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise BadRequest("request body: JSON nested too deeply") from None

    def _check_model(self, call: Call) -> None:
        if call.model is not None and call.model != self.model_name:
            raise BadRequest(f"model '{call.model}' not found; this server serves '{self.model_name}'", "model", 404)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        call = parse_completion(await self._body(request), self.max_tokens_default)
        self._check_model(call)
        if call.prompt_ids is not None:
            return await self._serve(request, call, call.prompt_ids, chat=False)
        text = call.prompt_text or ""
        self._check_length(len(text), call)
        ids = await asyncio.to_thread(lambda: self.tokenizer(text)["input_ids"])
        return await self._serve(request, call, ids, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        call = parse_chat(await self._body(request), self.max_tokens_default)
        self._check_model(call)
        self._check_length(sum(len(m["content"]) for m in call.messages or []), call)
        enc = await asyncio.to_thread(
            self.tokenizer.apply_chat_template,
            call.messages,
            add_generation_prompt=True,
            tokenize=True,
            chat_template=self.chat_template,
        )
        ids = enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else list(enc)
        return await self._serve(request, call, ids, chat=True)

    async def generate(self, request: web.Request) -> web.Response:
        """vLLM's token-level generate route (serve/generate_route.py), as verifiers' train client calls it."""
        g = generate_route.parse_generate(await self._body(request), self.max_tokens_default)
        self._check_model(g.call)
        samples = await self.engine.submit(self._request(g.call, g.call.prompt_ids or []))
        self.requests_served += 1
        return web.json_response(generate_route.generate_response(g, samples))

    def _check_length(self, chars: int, call: Call) -> None:
        """Refuse, before tokenising, a text too long to fit in the engine's max_seq_len."""
        limit = self.engine.max_seq_len
        at_least = math.ceil(chars / self._chars_per_token)
        if at_least + call.params.max_new_tokens > limit:
            raise BadRequest(
                f"prompt: {chars} characters are at least {at_least} tokens, which with max_tokens "
                f"{call.params.max_new_tokens} exceeds the engine's max_seq_len of {limit} tokens",
                "prompt",
            )

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _request(self, call: Call, prompt_ids: list[int]) -> GenerationRequest:
        """The engine request of a validated call; a 400 for ids or lengths the engine cannot take."""
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise BadRequest(f"prompt: token ids must be below the vocabulary size {vocab}", "prompt")
        req = GenerationRequest(next(self._ids), list(prompt_ids), call.n, call.params)
        self.engine.check(req)
        return req

    async def _serve(self, request: web.Request, call: Call, prompt_ids: list[int], chat: bool) -> web.StreamResponse:
        req = self._request(call, prompt_ids)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if call.stream:
            return await self._stream(request, call, req, rid, chat)
        samples = await self.engine.submit(req)
        self.requests_served += 1
        choices = [self._choice(i, s, call, chat) for i, s in enumerate(samples)]
        completion_tokens = sum(len(s.completion_ids) for s in samples)
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model_name,
                "choices": choices,
                "usage": {
                    "prompt_tokens": len(prompt_ids),
                    "completion_tokens": completion_tokens,
                    "total_tokens": len(prompt_ids) + completion_tokens,
                },
            }
        )

    def _choice(self, i: int, s: Sample, call: Call, chat: bool) -> dict[str, Any]:
        text = TextCutter(call.params.stop).final(self._text(s.completion_ids))
        choice: dict[str, Any] = {"index": i, "finish_reason": s.finish_reason, "nonstop": extension(s)}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if call.want_logprobs:
            choice["logprobs"] = self._logprobs(s.completion_ids, s.logprobs, chat)
        return choice

    def _logprobs(self, ids: list[int], logprobs: list[float], chat: bool) -> dict[str, Any]:
        """The sampled tokens' behaviour logprobs, in the chat or the legacy completions shape."""
        tokens = [self.tokenizer.decode([t]) for t in ids]
        if chat:
            return {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "replace")), "top_logprobs": []}
                    for t, lp in zip(tokens, logprobs)
                ]
            }
        return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None}

    async def _stream(
        self, request: web.Request, call: Call, req: GenerationRequest, rid: str, chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        ids: list[list[int]] = [[] for _ in range(req.n)]
        cutters = [TextCutter(call.params.stop) for _ in range(req.n)]

        async def send(index: int, text: str, finish: str | None, ext: dict[str, Any]) -> None:
            piece: dict[str, Any] = {"delta": {"content": text}} if chat else {"text": text}
            if call.want_logprobs and finish is None:
                piece["logprobs"] = self._logprobs(ext["token_ids"], ext["logprobs"], chat)
            chunk = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": [{"index": index, **piece, "finish_reason": finish, "nonstop": ext}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        completion_tokens = 0
        async for item in self.engine.stream(req):
            if isinstance(item, TokenEvent):
                ids[item.index].append(item.token_id)
                text = cutters[item.index].delta(self._text(ids[item.index]), finished=False)
                await send(
                    item.index,
                    text,
                    None,
                    {
                        "token_ids": [item.token_id],
                        "logprobs": [item.logprob],
                        "policy_versions": [item.policy_version],
                    },
                )
                continue
            for i, s in enumerate(item):
                completion_tokens += len(s.completion_ids)
                text = cutters[i].delta(self._text(s.completion_ids), finished=True)
                await send(i, text, s.finish_reason, extension(s))
        if call.include_usage:
            prompt_tokens = len(req.prompt_ids)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            }
            chunk = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage,
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.requests_served += 1
        return resp
