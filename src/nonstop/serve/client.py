"""Async clients for agent environments: the same calls in process or over HTTP.

`GenerationClient` is the seam: `complete(prompt_ids, params, n)` returns n `Sample`s (token
ids, behaviour logprobs, policy versions, Keep Sampling Mask), `chat(messages, params, n)` the
same for a chat conversation, with the text in `Sample.text`. `InProcessClient` calls an
`AsyncEngine` in the same event loop (no serialisation); `HttpClient` talks to `nonstop serve`
(or any server speaking the `nonstop` extension) and raises `ServerError` carrying the HTTP
status and the server's message. Both return tokens exactly as the engine produced them, so
callers never retokenise.
"""

from __future__ import annotations

from typing import Any, Protocol

import aiohttp

from nonstop.engine.aio import AsyncEngine
from nonstop.errors import ServeError
from nonstop.serve.protocol import sample_from_extension
from nonstop.serve.server import DEFAULT_CHAT_TEMPLATE
from nonstop.types import GenerationRequest, Sample, SamplingParams


class ServerError(ServeError, RuntimeError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class GenerationClient(Protocol):
    async def complete(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> list[Sample]: ...

    async def chat(self, messages: list[dict[str, str]], params: SamplingParams, n: int = 1) -> list[Sample]: ...

    async def close(self) -> None: ...


class InProcessClient:
    def __init__(self, engine: AsyncEngine, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self._next_id = 0

    async def complete(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> list[Sample]:
        self._next_id += 1
        samples = await self.engine.submit(GenerationRequest(self._next_id, list(prompt_ids), n, params))
        for s in samples:
            s.text = self.tokenizer.decode(s.completion_ids, skip_special_tokens=True)
        return samples

    async def chat(self, messages: list[dict[str, str]], params: SamplingParams, n: int = 1) -> list[Sample]:
        template = None if self.tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
        enc = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, chat_template=template
        )
        return await self.complete(enc["input_ids"] if hasattr(enc, "keys") else list(enc), params, n)

    async def close(self) -> None:
        """Nothing to release: the engine belongs to its owner."""


def _body(params: SamplingParams, n: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "n": n,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
    }
    if params.seed is not None:
        body["seed"] = params.seed
    if model is not None:
        body["model"] = model
    return body


class HttpClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        model: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 64,
    ) -> None:
        self.base_url, self.model = base_url.rstrip("/"), model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session = aiohttp.ClientSession(
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            connector=aiohttp.TCPConnector(limit=max_connections),
        )

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._session.post(self.base_url + path, json=body) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise ServerError(r.status, (data.get("error") or {}).get("message", str(data)))
            return data

    @staticmethod
    def _samples(data: dict[str, Any], chat: bool) -> list[Sample]:
        out = []
        for c in sorted(data["choices"], key=lambda c: c["index"]):
            s = sample_from_extension(c["nonstop"], c["finish_reason"])
            s.text = c["message"]["content"] if chat else c["text"]
            out.append(s)
        return out

    async def complete(self, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> list[Sample]:
        data = await self._post("/v1/completions", {"prompt": list(prompt_ids), **_body(params, n, self.model)})
        return self._samples(data, chat=False)

    async def chat(self, messages: list[dict[str, str]], params: SamplingParams, n: int = 1) -> list[Sample]:
        data = await self._post("/v1/chat/completions", {"messages": messages, **_body(params, n, self.model)})
        return self._samples(data, chat=True)

    async def health(self) -> dict[str, Any]:
        async with self._session.get(self.base_url + "/health") as r:
            return await r.json()

    async def close(self) -> None:
        await self._session.close()
