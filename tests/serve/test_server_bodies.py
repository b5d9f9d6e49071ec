"""Request bodies a client does not finish, or announces too large, and the completions `logprobs`
field, over real sockets and HTTP on 127.0.0.1: a half-sent body gets 408 after the server's bound,
a Content-Length over the limit gets 413 before anything is read, `logprobs: 0` returns the
sampled tokens' logprobs and a boolean `logprobs` on completions is refused (docs/engine.md)."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from nonstop.config import EngineConfig
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.serve.server import MAX_BODY_BYTES, EngineServer

BODY_TIMEOUT_S = 1.0


def _with_server(tiny_dir, body):
    """Run `body(port, tok)` against an EngineServer on 127.0.0.1 whose body timeout is BODY_TIMEOUT_S."""
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(
        load_model(str(tiny_dir)),
        [tok.eos_token_id],
        tok.pad_token_id,
        settings=EngineConfig(max_seq_len=64),
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )

    async def main():
        aio = AsyncEngine(engine)
        server = EngineServer(aio, tok, "tiny", body_timeout_s=BODY_TIMEOUT_S)
        port = await server.start("127.0.0.1", 0)
        try:
            return await body(port, tok)
        finally:
            await server.stop()
            await aio.close()

    return asyncio.run(main())


async def _raw(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str], dict, float]:
    """Send `head` and `body` on a fresh connection and read one response; returns its status,
    headers, JSON body and the seconds it took to come."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        t0 = time.perf_counter()
        writer.write(head + body)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        took_s = time.perf_counter() - t0
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, v = line.decode().split(":", 1)
            headers[k.strip().lower()] = v.strip()
        payload = await reader.readexactly(int(headers["content-length"]))
        return int(status_line.split()[1]), headers, json.loads(payload), took_s
    finally:
        writer.close()


def _head(length: int) -> bytes:
    return (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_a_half_sent_body_gets_408_and_an_oversized_length_413_before_any_read(tiny_dir):
    async def body(port, tok):
        # headers and 10 of the 100 bytes announced, then nothing: 408 once the bound has passed
        status, headers, out, took_s = await _raw(port, _head(100), b'{"prompt":')
        assert status == 408, out
        assert "not received within 1 s" in out["error"]["message"] and out["error"]["code"] == 408
        assert headers.get("connection") == "close"  # the rest of that body can never be told apart
        assert BODY_TIMEOUT_S * 0.9 <= took_s < BODY_TIMEOUT_S + 10, took_s
        # an announced length over the limit, with no body at all: refused from the header. A read
        # would wait out the bound and answer 408; 413 naming the length shows nothing was read
        status, headers, out, _ = await _raw(port, _head(1_000_000_000_000))
        assert status == 413, out
        assert "1000000000000 bytes" in out["error"]["message"] and str(MAX_BODY_BYTES) in out["error"]["message"]
        assert headers.get("connection") == "close"
        # the server goes on serving
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [5], "max_tokens": 1}) as r:
                assert r.status == 200, await r.text()

    _with_server(tiny_dir, body)


def test_completions_logprobs_zero_returns_them_and_booleans_are_refused(tiny_dir):
    async def body(port, tok):
        url = f"http://127.0.0.1:{port}"
        base = {"prompt": "12+34=", "max_tokens": 4, "temperature": 0}
        async with aiohttp.ClientSession() as s:

            async def post(path, payload):
                async with s.post(url + path, json=payload) as r:
                    return r.status, await r.json()

            # 0 (no alternatives) and 1 (the sampled token only: nonstop has no alternatives) answer alike
            answers = {}
            for n in (0, 1):
                status, out = await post("/v1/completions", {**base, "logprobs": n})
                assert status == 200, out
                c = out["choices"][0]
                assert c["logprobs"] is not None, (n, c)
                assert c["logprobs"]["token_logprobs"] == c["nonstop"]["logprobs"] and c["nonstop"]["logprobs"]
                answers[n] = c["logprobs"]
            assert answers[0] == answers[1]
            status, out = await post("/v1/completions", base)  # not asked: none
            assert status == 200 and out["choices"][0].get("logprobs") is None, out
            # completions' logprobs is an integer (OpenAI's legacy API): true and false are refused,
            # as every boolean sent for an integer is; chat's logprobs is the boolean one
            for v in (True, False):
                status, out = await post("/v1/completions", {**base, "logprobs": v})
                assert status == 400 and out["error"]["param"] == "logprobs", (v, out)
            chat = {"messages": [{"role": "user", "content": "1="}], "max_tokens": 2}
            status, out = await post("/v1/chat/completions", {**chat, "logprobs": 1})
            assert status == 400 and out["error"]["param"] == "logprobs", out
            status, out = await post("/v1/chat/completions", {**chat, "logprobs": True})
            assert status == 200 and out["choices"][0]["logprobs"]["content"], out

    _with_server(tiny_dir, body)
