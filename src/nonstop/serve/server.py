"""OpenAI-compatible HTTP server over the engine (aiohttp): token-in, token-out.

The engine is any `ServedEngine`: the built-in engine's AsyncEngine (engine.kind builtin) or
the vLLM engine (engine/vllm/engine.py VllmEngineWorker, engine.kind vllm); the routes, the
validation and the response shapes are the same for both.

Routes: `GET /health`, `GET /v1/models`, `POST /v1/completions` (prompt as text or token ids),
`POST /v1/chat/completions` (messages through the tokenizer's chat template, or a plain
built-in one when the tokenizer has none), and vLLM's token-level `POST /inference/v1/generate`
(serve/generate_route.py: what verifiers' train client calls); the first two stream as server-sent events with
`"stream": true`. Every choice carries the `nonstop` extension (engine token ids, behaviour
logprobs, policy versions, Keep Sampling Mask; serve/protocol.py). The answers are written by
serve/answers.py's `Answers`, which `EngineServer` extends.

Contract: binds 127.0.0.1 unless told otherwise; with an API key, `/v1/*` and `/inference/*` need
`Authorization: Bearer <key>` (401 otherwise). Malformed or too deeply nested JSON or a bad field ->
400 naming it; a prompt over the engine's limits -> 400 naming the limit, decided from the text's
length before tokenising when the text cannot fit, and tokenised off the event loop otherwise (so
`/health` answers while a large prompt is read); a body over 8 MiB -> 413, before any of it is read
when its Content-Length says so; a body not received within `body_timeout_s` (30 s by default: a
client that sent less than its Content-Length) -> 408; a wrong method -> 405; an unknown model or
route -> 404; anything unexpected -> 500 for that request only. Errors are JSON `{"error":
{"message", "type", "param", "code"}}`, typed as OpenAI types them. A request never reaches the
engine before it is fully validated, and a client that disconnects (streamed or not) has its
sequences aborted and gets one log line, so no bad or abandoned request can take the engine down.
`start()` raises `ServeError` with a plain message when the address cannot be bound. `stop()` waits
at most SHUTDOWN_GRACE_S for requests in flight, then cancels them (aborting their sequences), so a
stalled client cannot hold Ctrl-C up.

With an `EpisodeRecorder` (serve/recorder.py: a training run's agents endpoint), a completion or
chat request that names an episode (`X-Episode-Id` and `X-Group-Id` headers, or `episode_id` and
`group_id` body fields) is generated from the episode's recorded tokens and recorded, and
`POST /v1/episodes/{id}/reward` and `GET /v1/episodes/{id}` are served; requests without an
episode id are served and not recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
from typing import Any

from aiohttp import web

from nonstop.engine.scheduler import RequestError
from nonstop.errors import ServeError
from nonstop.serve import generate_route, openapi
from nonstop.serve import responses as r
from nonstop.serve.answers import Answers
from nonstop.serve.episode_record import Turn, episode_tag
from nonstop.serve.protocol import BadRequest, Call, ServedEngine, parse_chat, parse_completion
from nonstop.serve.recorder import EpisodeRecorder
from nonstop.types import GenerationRequest

log = logging.getLogger("nonstop.serve")

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    kind = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error"
    )
    detail = r.ErrorDetail(message=message, type=kind, param=param, code=status)  # type: ignore[arg-type]
    return web.json_response(r.ErrorResponse(error=detail).json_object(), status=status)


def _closing(response: web.Response) -> web.Response:
    """`response` with `Connection: close`: the body of its request was not (all) read, so the
    connection cannot carry another request."""
    response.force_close()
    return response


MAX_UNKNOWN_LOGGED = 256
"""Distinct unknown field names logged at most (a fuzzer would otherwise fill the log)."""

MAX_BODY_BYTES = 8 * 2**20
"""Largest request body; the biggest prompt the engine takes is far smaller, as JSON text."""

BODY_TIMEOUT_S = 30.0
"""Default bound on receiving a request's body: a client that sends less than its Content-Length
holds a connection and a handler until then, and gets 408."""

SHUTDOWN_GRACE_S = 0.25
"""How long `stop()` lets requests in flight finish before cancelling them. aiohttp waits this
twice at most (to finish, then to cancel), so Ctrl-C stops the server within half a second
whatever its clients do (aiohttp's own default, 60 s, let a half-sent body hold it up that long)."""


class EngineServer(Answers):
    def __init__(
        self,
        engine: ServedEngine,
        tokenizer: Any,
        model_name: str,
        api_key: str | None = None,
        max_tokens_default: int = 16,
        recorder: EpisodeRecorder | None = None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.body_timeout_s = body_timeout_s
        self.recorder = recorder
        self.activity = asyncio.Event()  # set by every request (a run's endpoint lingers while agents ask)
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
        self._unknown_logged: set[str] = set()
        self._openapi: dict[str, Any] | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post(generate_route.PATH, self.generate)
        app.router.add_get(openapi.PATH, self.schema)
        if self.recorder is not None:
            app.router.add_post("/v1/episodes/{episode_id}/reward", self.reward)
            app.router.add_get("/v1/episodes/{episode_id}", self.episode)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve in the running loop; returns the bound port (port 0 picks a free one)."""
        if not 0 <= port <= 65535:
            raise ServeError(f"port {port}: expected 0 (any free port) to 65535")
        # handler_cancellation: a client that hangs up cancels its handler, which aborts its sequences
        self._runner = web.AppRunner(
            self.app(), access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S
        )
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
        self.activity.set()
        if self.api_key is not None and request.path.startswith(("/v1/", "/inference/")):
            if request.headers.get("Authorization", "") != f"Bearer {self.api_key}":
                return _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        if (request.content_length or 0) > MAX_BODY_BYTES:  # refused from the header: nothing is read
            self.requests_failed += 1
            return _closing(
                _error(413, f"request body: {request.content_length} bytes, over the limit of {MAX_BODY_BYTES}")
            )
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            self.requests_disconnected += 1
            log.info("client disconnected from %s %s; its generation was aborted", request.method, request.path)
            raise asyncio.CancelledError from None
        except BadRequest as e:
            self.requests_failed += 1
            refused = _error(e.status, str(e), e.param)
            return _closing(refused) if e.status == 408 else refused
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
        h = self.engine.health()
        out = r.Health(
            model=self.model_name, policy_version=h["policy_version"], running=h["running"], waiting=h["waiting"]
        )
        return web.json_response(out.json_object())

    async def models(self, request: web.Request) -> web.Response:
        card = r.ModelCard(id=self.model_name, max_model_len=self.engine.max_seq_len)
        return web.json_response(r.ModelList(data=[card]).json_object())

    async def schema(self, request: web.Request) -> web.Response:
        """The OpenAPI document (serve/openapi.py), built on first use."""
        if self._openapi is None:
            self._openapi = openapi.openapi(
                self.model_name, self.api_key is not None, self.engine.max_seq_len, self.engine.vocab_size
            )
        return web.json_response(self._openapi)

    async def _body(self, request: web.Request) -> Any:
        if request.content_type != "application/json":  # aiohttp reads a missing type as octet-stream
            sent = request.headers.get("Content-Type")
            raise BadRequest(
                f"request body: send JSON with Content-Type: application/json (got {sent or 'no Content-Type'})",
                status=415,
            )
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout_s)
        except TimeoutError:
            raise BadRequest(
                f"request body: not received within {self.body_timeout_s:g} s "
                f"({request.content_length} bytes announced by Content-Length)",
                status=408,
            ) from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise BadRequest("request body: JSON nested too deeply") from None

    def _check_model(self, call: Call, route: str) -> None:
        if call.model is not None and call.model != self.model_name:
            raise BadRequest(f"model '{call.model}' not found; this server serves '{self.model_name}'", "model", 404)
        fresh = [k for k in call.unknown if k not in self._unknown_logged]
        if fresh and len(self._unknown_logged) < MAX_UNKNOWN_LOGGED:  # accepted, as OpenAI servers do, but said
            self._unknown_logged.update(fresh)
            log.warning(
                "%s: ignored field(s) nonstop does not know: %s", route, ", ".join(ascii(k)[:60] for k in fresh)
            )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        eid, gid = episode_tag(request.headers, body)
        call = parse_completion(body, self.max_tokens_default)
        self._check_model(call, request.path)
        if eid is not None:
            if call.prompt_ids is not None:
                turn = self._begin(call, eid, gid, "prompt", ids=list(call.prompt_ids))
            else:
                text = call.prompt_text or ""
                self._check_length(len(text), call, "prompt")
                turn = self._begin(
                    call, eid, gid, "prompt", text=text, first_ids=lambda: self.tokenizer(text)["input_ids"]
                )
            return await self._serve_turn(request, call, turn, chat=False)
        if call.prompt_ids is not None:
            return await self._serve(request, call, call.prompt_ids, chat=False)
        text = call.prompt_text or ""
        self._check_length(len(text), call, "prompt")
        ids = await asyncio.to_thread(lambda: self.tokenizer(text)["input_ids"])
        return await self._serve(request, call, ids, chat=False)

    def _begin(self, call: Call, eid: str, gid: str | None, param: str, **prompt: Any) -> Turn:
        """Admit a request of a recorded episode (serve/recorder.py): one completion, on a recording server."""
        if self.recorder is None:
            raise BadRequest(
                "episode_id: this server does not record episodes (a training run's agents endpoint does)",
                "episode_id",
            )
        if call.n != 1:
            raise BadRequest(f"n: a recorded episode takes one completion per request (got {call.n})", "n")
        return self.recorder.begin_turn(eid, gid, param=param, **prompt)

    async def _serve_turn(self, request: web.Request, call: Call, turn: Turn, chat: bool) -> web.StreamResponse:
        assert self.recorder is not None
        try:
            return await self._serve(request, call, turn.prefix, chat, turn=turn)
        finally:
            self.recorder.abort_turn(turn)  # no-op after end_turn; else nothing of the turn is recorded

    async def reward(self, request: web.Request) -> web.Response:
        """`POST /v1/episodes/{id}/reward` {"reward": number}: the episode's final reward."""
        assert self.recorder is not None
        body = await self._body(request)
        value = body.get("reward") if isinstance(body, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest('reward: expected a finite number, as {"reward": 1.0}', "reward")
        return web.json_response(self.recorder.reward(request.match_info["episode_id"], float(value)))

    async def episode(self, request: web.Request) -> web.Response:
        """`GET /v1/episodes/{id}`: what is recorded of an episode (for debugging an agent)."""
        assert self.recorder is not None
        return web.json_response(self.recorder.describe(request.match_info["episode_id"]))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        eid, gid = episode_tag(request.headers, body)
        call = parse_chat(body, self.max_tokens_default)
        self._check_model(call, request.path)
        self._check_length(sum(len(m["content"]) for m in call.messages or []), call, "messages")
        if eid is not None:
            # the rendered text is what a later turn must extend; the first turn's ids are the template's own
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                call.messages,
                add_generation_prompt=True,
                tokenize=False,
                chat_template=self.chat_template,
            )
            turn = self._begin(
                call,
                eid,
                gid,
                "messages",
                text=text,
                first_ids=lambda: list(self.tokenizer(text, add_special_tokens=False)["input_ids"]),
            )
            return await self._serve_turn(request, call, turn, chat=True)
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
        self._check_model(g.call, request.path)
        samples = await self.engine.submit(self._request(g.call, g.call.prompt_ids or [], "token_ids"))
        self.requests_served += 1
        return web.json_response(generate_route.generate_response(g, samples))

    def _check_max_tokens(self, call: Call, param: str = "max_tokens") -> None:
        """max_tokens that leave no room for even a one-token prompt: the error names max_tokens."""
        limit = self.engine.max_seq_len
        if call.params.max_new_tokens >= limit:
            raise BadRequest(
                f"{param}: {call.params.max_new_tokens} leaves no room for a prompt in the engine's "
                f"max_seq_len of {limit} tokens (at most {limit - 1})",
                param,
            )

    def _check_length(self, chars: int, call: Call, field: str) -> None:
        """Refuse, before tokenising, a text too long to fit in the engine's max_seq_len."""
        self._check_max_tokens(call)
        limit = self.engine.max_seq_len
        at_least = math.ceil(chars / self._chars_per_token)
        if at_least + call.params.max_new_tokens > limit:
            raise BadRequest(
                f"{field}: {chars} characters are at least {at_least} tokens, which with max_tokens "
                f"{call.params.max_new_tokens} exceeds the engine's max_seq_len of {limit} tokens",
                field,
            )

    def _request(self, call: Call, prompt_ids: list[int], field: str) -> GenerationRequest:
        """The engine request of a validated call; a 400 for ids or lengths the engine cannot take."""
        vocab = self.engine.vocab_size
        if any(t >= vocab for t in prompt_ids):
            raise BadRequest(f"{field}: token ids must be below the vocabulary size {vocab}", field)
        self._check_max_tokens(call, "sampling_params.max_tokens" if field == "token_ids" else "max_tokens")
        if len(prompt_ids) + call.params.max_new_tokens > self.engine.max_seq_len:
            raise BadRequest(
                f"{field}: {len(prompt_ids)} tokens with max_tokens {call.params.max_new_tokens} exceed the "
                f"engine's max_seq_len of {self.engine.max_seq_len} tokens",
                field,
            )
        req = GenerationRequest(next(self._ids), list(prompt_ids), call.n, call.params)
        self.engine.check(req)
        return req
