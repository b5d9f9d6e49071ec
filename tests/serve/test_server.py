"""The OpenAI-compatible server over real HTTP on 127.0.0.1, and the async clients."""

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from nonstop.config import EngineConfig
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.serve.client import HttpClient, InProcessClient, ServerError
from nonstop.types import GenerationRequest, SamplingParams
from support import child_env
from support.served import serving

NAME = "tiny-test"


def _run_with_server(tiny_dir, body, api_key=None, **settings):
    """Start engine + server in this loop on 127.0.0.1, run `body(url, aio, tok)`, shut down."""
    tok = load_tokenizer(str(tiny_dir))
    settings = {"max_seq_len": 64, **settings}
    engine = TorchEngine(
        load_model(str(tiny_dir)),
        [tok.eos_token_id],
        tok.pad_token_id,
        settings=EngineConfig(**settings),
        detokenize=lambda ids: tok.decode(ids, skip_special_tokens=True),
    )

    async def main():
        aio = AsyncEngine(engine)
        async with serving(aio, tok, NAME, api_key=api_key) as url:
            return await body(url, aio, tok)

    return asyncio.run(main())


async def _post(session, url, body, raw=None):
    async with session.post(
        url, data=raw if raw is not None else json.dumps(body), headers={"Content-Type": "application/json"}
    ) as r:
        return r.status, await r.json(content_type=None)


async def _sse(session, url, body):
    chunks = []
    async with session.post(url, json=body) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: "):
                chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def test_completions_chat_and_streaming_round_trip_tokens(tiny_dir):
    async def body(url, aio, tok):
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as r:
                health = await r.json()
            assert r.status == 200 and health["status"] == "ok" and health["model"] == NAME
            prompt = tok("12+34=")["input_ids"]
            direct = (await aio.generate([GenerationRequest(0, prompt, 1, SamplingParams(8, 0.0))]))[0][0]
            # text prompt and token prompt give the engine's own tokens back, with metadata
            for p in ("12+34=", prompt):
                status, out = await _post(
                    s,
                    url + "/v1/completions",
                    {"model": NAME, "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 1},
                )
                assert status == 200 and out["object"] == "text_completion"
                c = out["choices"][0]
                ext = c["nonstop"]
                assert ext["prompt_token_ids"] == prompt and ext["token_ids"] == direct.completion_ids
                assert ext["logprobs"] == pytest.approx(direct.logprobs, abs=1e-5) and ext["policy_versions"] == [0] * 8
                assert c["text"] == tok.decode(direct.completion_ids, skip_special_tokens=True)
                assert c["logprobs"]["token_logprobs"] == ext["logprobs"]
                assert out["usage"]["completion_tokens"] == len(direct.completion_ids)
            # streaming: the deltas add up to the non-streamed text, token by token
            chunks = await _sse(
                s, url + "/v1/completions", {"prompt": "12+34=", "max_tokens": 8, "temperature": 0, "stream": True}
            )
            assert "".join(c["choices"][0]["text"] for c in chunks) == c["text"]
            assert [t for ch in chunks[:-1] for t in ch["choices"][0]["nonstop"]["token_ids"]] == direct.completion_ids
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            # chat, plain and streamed, n = 3 with truncated sampling: masks come back per token
            msgs = [{"role": "user", "content": "2+2="}]
            status, out = await _post(
                s,
                url + "/v1/chat/completions",
                {"model": NAME, "messages": msgs, "n": 3, "max_tokens": 5, "top_k": 4, "seed": 1},
            )
            assert status == 200 and len(out["choices"]) == 3
            for c in out["choices"]:
                assert c["message"]["role"] == "assistant"
                assert len(c["nonstop"]["sampling_mask"]) == len(c["nonstop"]["token_ids"])
                assert all(len(m) == 4 for m in c["nonstop"]["sampling_mask"])
            chunks = await _sse(
                s, url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "temperature": 0, "stream": True}
            )
            assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            # stop strings are cut from the text, streamed or not
            free = ext["token_ids"]
            stop_text = tok.decode(free[2:4], skip_special_tokens=True)
            status, out = await _post(
                s, url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": stop_text}
            )
            full = tok.decode(free, skip_special_tokens=True)
            assert (
                out["choices"][0]["text"] == full[: full.find(stop_text)]
                and out["choices"][0]["finish_reason"] == "stop"
            )
            chunks = await _sse(
                s,
                url + "/v1/completions",
                {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stop": [stop_text], "stream": True},
            )
            assert "".join(c["choices"][0]["text"] for c in chunks) == out["choices"][0]["text"]

    _run_with_server(tiny_dir, body)


def test_bad_requests_get_clear_errors_and_never_take_the_engine_down(tiny_dir):
    async def body(url, aio, tok):
        async with aiohttp.ClientSession() as s:
            cases = [
                (None, "{not json", 400, "not valid JSON"),
                ({"prompt": "1+" * 40, "max_tokens": 4}, None, 400, "max_seq_len of 64"),
                ({"model": "gpt-9", "prompt": "1="}, None, 404, "model 'gpt-9' not found"),
                ({"prompt": "1=", "temperature": "hot"}, None, 400, "temperature"),
                ({"prompt": "1=", "max_tokens": 0}, None, 400, "max_tokens"),
                ({"prompt": "", "max_tokens": 3}, None, 400, "prompt"),
                ({"prompt": [1, -3]}, None, 400, "prompt"),
                ({"prompt": [1, 100000]}, None, 400, "vocabulary size"),
                ({"prompt": "1=", "n": 500}, None, 400, "n"),
                ({"prompt": "1=", "top_p": 1.5}, None, 400, "top_p"),
                ([1, 2], None, 400, "JSON object"),
            ]
            for payload, raw, status, words in cases:
                got, out = await _post(s, url + "/v1/completions", payload, raw)
                assert got == status and words in out["error"]["message"], (payload, raw, out)
            got, out = await _post(s, url + "/v1/chat/completions", {"messages": [{"role": "user"}]})
            assert got == 400 and out["error"]["param"] == "messages"
            async with s.get(url + "/v1/nothing") as r:
                assert r.status == 404 and "error" in await r.json()
            got, out = await _post(s, url + "/v1/completions", {"prompt": "1+1=", "max_tokens": 3})
            assert got == 200 and len(out["choices"][0]["nonstop"]["token_ids"]) <= 3
        assert not aio.engine.has_work()

    _run_with_server(tiny_dir, body)


def test_api_key_is_required_when_set(tiny_dir):
    async def body(url, aio, tok):
        async with aiohttp.ClientSession() as s:
            got, out = await _post(s, url + "/v1/completions", {"prompt": "1=", "max_tokens": 2})
            assert got == 401
            async with s.get(url + "/health") as r:
                assert r.status == 200
        client = HttpClient(url, api_key="sekrit", model=NAME)
        try:
            assert len((await client.complete(tok("1=")["input_ids"], SamplingParams(2, 0.0)))[0].completion_ids) <= 2
        finally:
            await client.close()
        wrong = HttpClient(url, api_key="nope")
        try:
            with pytest.raises(ServerError, match="HTTP 401"):
                await wrong.complete([5], SamplingParams(2, 0.0))
        finally:
            await wrong.close()

    _run_with_server(tiny_dir, body, api_key="sekrit")


def test_64_concurrent_clients_and_both_clients_agree(tiny_dir):
    async def body(url, aio, tok):
        http = HttpClient(url, model=NAME)
        local = InProcessClient(aio, tok)
        try:

            async def one(i):
                prompt = tok(f"{i}+{i}=")["input_ids"]
                if i % 4 == 3:  # a quarter stream, through raw HTTP
                    async with aiohttp.ClientSession() as s:
                        chunks = await _sse(
                            s,
                            url + "/v1/completions",
                            {"prompt": prompt, "max_tokens": 4 + i % 7, "stream": True, "n": 2},
                        )
                    return {c["choices"][0]["index"] for c in chunks} == {0, 1}
                samples = await http.complete(prompt, SamplingParams(4 + i % 7, 1.0, seed=i), n=1 + i % 3)
                return len(samples) == 1 + i % 3 and all(len(s.versions) == len(s.completion_ids) for s in samples)

            results = await asyncio.gather(*(one(i) for i in range(64)))
            assert all(results)
            prompt = tok("7+7=")["input_ids"]
            a = await http.complete(prompt, SamplingParams(6, 0.0))
            b = await local.complete(prompt, SamplingParams(6, 0.0))
            assert a[0].completion_ids == b[0].completion_ids and a[0].text == b[0].text
            ca = await http.chat([{"role": "user", "content": "hi"}], SamplingParams(4, 0.0))
            cb = await local.chat([{"role": "user", "content": "hi"}], SamplingParams(4, 0.0))
            assert ca[0].completion_ids == cb[0].completion_ids and ca[0].prompt_ids == cb[0].prompt_ids
        finally:
            await http.close()
        stats = aio.engine.scheduler.stats
        assert stats["decode_steps"] < stats["tokens_generated"] / 4  # the clients shared decode steps

    _run_with_server(tiny_dir, body, max_concurrent_seqs=32)


def test_client_disconnect_mid_stream_frees_the_engine(tiny_dir):
    async def body(url, aio, tok):
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url + "/v1/completions",
                json={"prompt": "1=", "max_tokens": 60, "stream": True, "n": 4, "stop_token_ids": []},
            ) as r:
                await r.content.readline()  # first event, then hang up
        for _ in range(200):
            if not aio.engine.has_work():
                break
            await asyncio.sleep(0.01)
        assert not aio.engine.has_work()

    _run_with_server(tiny_dir, body, max_seq_len=128)


def test_nonstop_serve_command(tiny_dir, tmp_path):
    env = child_env(PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "nonstop.cli", "serve", "--model", str(tiny_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    try:
        line = ""
        for line in proc.stdout:
            if "serving" in line:
                break
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)

        async def talk():
            client = HttpClient(url, model=Path(tiny_dir).name)
            try:
                return await client.complete([5, 6, 7], SamplingParams(3, 0.0)), await client.health()
            finally:
                await client.close()

        samples, health = asyncio.run(talk())
        assert len(samples[0].completion_ids) <= 3 and health["status"] == "ok"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
