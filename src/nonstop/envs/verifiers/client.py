"""verifiers' model calls answered by nonstop's engines: `train_client` is verifiers' own train
client (its renderer, its `/inference/v1/generate` calls) with each answer's per-token policy
versions logged by request id (`VersionLog`); `EngineTransport` answers those calls in process
from any `TurnEngine`, with the JSON the HTTP route sends (serve/generate_route.py), so a
training run needs no socket.

Imported by envs/verifiers/env.py (after its check that the verifiers extra is installed) and
envs/verifiers/agent.py.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.clients import TrainClient

from nonstop.engine.scheduler import RequestError
from nonstop.envs.base import TurnEngine
from nonstop.envs.verifiers.renderer import renderer_config
from nonstop.serve import generate_route
from nonstop.serve.protocol import BadRequest
from nonstop.types import GenerationRequest


class EngineTransport(httpx.AsyncBaseTransport):
    """`/inference/v1/generate` and `/v1/models` answered in process by a `TurnEngine`, with the
    JSON the HTTP route sends (serve/generate_route.py).

    With `clamp`, `max_model_len` is the episode's token budget: a turn samples at most what is left
    of it (`max_tokens` lowered, as nonstop's own episodes do), and a prompt that leaves nothing is
    a 400 whose message names the "maximum context length", which verifiers' chat program reads as
    the context being used up (it ends the episode with its transcript, not as a failure)."""

    def __init__(
        self,
        engine: TurnEngine,
        model: str,
        max_model_len: int | None = None,
        max_tokens_default: int = 16,
        clamp: bool = False,
    ) -> None:
        self.engine, self.model, self.max_model_len = engine, model, max_model_len
        self.max_tokens_default, self.clamp = max_tokens_default, clamp
        self._ids = itertools.count(1 << 41)  # apart from the episode runner's and the producer's request ids
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.endswith("/models"):
            card: dict[str, Any] = {"id": self.model, "object": "model", "owned_by": "nonstop"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return httpx.Response(200, json={"object": "list", "data": [card]})
        if request.method != "POST" or not path.endswith(generate_route.PATH):
            return httpx.Response(404, json={"error": {"message": f"{request.method} {path}: not served in process"}})
        try:
            g = generate_route.parse_generate(json.loads(await request.aread()), self.max_tokens_default)
        except BadRequest as e:
            return httpx.Response(e.status, json={"error": {"message": str(e), "param": e.param}})
        if self.clamp and self.max_model_len is not None:
            left = self.max_model_len - len(g.call.prompt_ids or [])
            if left < 1:
                message = (
                    f"prompt of {len(g.call.prompt_ids or [])} tokens leaves no room within the "
                    f"maximum context length of {self.max_model_len} tokens (env.max_episode_tokens)"
                )
                return httpx.Response(400, json={"error": {"message": message, "param": "token_ids"}})
            g.call.params.max_new_tokens = min(g.call.params.max_new_tokens, left)
        try:
            samples = (
                await self.engine.generate(
                    [GenerationRequest(next(self._ids), g.call.prompt_ids or [], g.call.n, g.call.params)]
                )
            )[0]
        except RequestError as e:  # a request the engine cannot take (too long, bad ids): the client's 400
            return httpx.Response(400, json={"error": {"message": str(e), "param": "token_ids"}})
        self.requests += 1
        return httpx.Response(200, json=generate_route.generate_response(g, samples))


class VersionLog:
    """Per-token policy versions of generate answers, by request id (an httpx response hook)."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[int]] = {}

    async def __call__(self, response: httpx.Response) -> None:
        if response.status_code != 200 or not response.request.url.path.endswith(generate_route.PATH):
            return
        data = json.loads(await response.aread())
        self.by_request[data["request_id"]] = list(data["choices"][0]["nonstop"]["policy_versions"])

    def pop(self, request_id: str) -> list[int] | None:
        return self.by_request.pop(request_id, None)


def train_client(
    base_url: str, renderer_model: str, transport: httpx.AsyncBaseTransport | None = None, api_key: str | None = None
) -> tuple[TrainClient, VersionLog]:
    """verifiers' train client against `base_url` (or `transport`), its versions logged."""
    config = vf.TrainClientConfig(
        base_url=base_url, api_key_var="NONSTOP_API_KEY", renderer=renderer_config(), renderer_model_name=renderer_model
    )
    client = TrainClient(config)
    log = VersionLog()
    client.client = AsyncOpenAI(
        base_url=base_url,
        api_key=api_key or "EMPTY",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, event_hooks={"response": [log]}),
    )
    return client, log
