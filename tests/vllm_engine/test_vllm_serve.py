"""`nonstop serve --engine vllm`: the real vLLM (CPU) behind the OpenAI-compatible server, over
real HTTP on 127.0.0.1, in .venv-vllm (`make test-vllm`).

One server process for the module (vLLM loads in 20-60 s on a busy machine); each test talks to
it as a client would. The behaviour logprobs it returns are checked against the trainer's own
recomputation with the bounds of tests/vllm_engine/test_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from nonstop.hf import load_model, load_tokenizer
from nonstop.models.shipped import shipped_dir
from nonstop.serve.client import HttpClient
from nonstop.serve.protocol import sample_from_extension
from nonstop.types import SamplingParams
from support import child_env
from support.cli import sets

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm import MAX_ABS_LOG_RATIO, MEAN_ABS_LOG_RATIO, abs_log_ratios, as_groups  # noqa: E402

START_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """`nonstop serve --engine vllm` on the shipped base; yields its base URL."""
    cwd = tmp_path_factory.mktemp("serve")
    env = child_env(PYTHONUNBUFFERED="1", COLUMNS="200")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nonstop.cli",
            "serve",
            "--engine",
            "vllm",
            "--model",
            str(shipped_dir()),
            "--port",
            "0",
            *sets({"engine.vllm.kv_cache_gib": 0.25, "engine.vllm.max_num_seqs": 32}),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
    )
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(
        target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True, name="serve-output"
    )
    reader.start()
    seen: list[str] = []
    deadline = time.monotonic() + START_TIMEOUT_S
    url = None
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        seen.append(line)
        if m := re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line):
            url = m.group(1)
    try:
        assert url is not None, "server did not start:\n" + "".join(seen)
        yield url
    finally:
        proc.terminate()
        rc = proc.wait(timeout=60)
        assert rc == 0, "".join(seen)


def _run(coro_fn, url: str):
    import aiohttp

    async def main():
        async with aiohttp.ClientSession() as session:
            return await coro_fn(session, url)

    return asyncio.run(main())


async def _post(session, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, json=body) as r:
        return r.status, await r.json(content_type=None)


def test_completions_return_tokens_logprobs_and_versions_of_the_policy_vllm_sampled(server):
    tok = load_tokenizer(str(shipped_dir()))
    prompts = [f"{3 * i:02d}+{7 * i % 100:02d}=" for i in range(6)]

    async def talk(session, url):
        async with session.get(f"{url}/health") as r:
            health = await r.json()
        outs = [
            await _post(
                session,
                f"{url}/v1/completions",
                {"prompt": p, "n": 4, "max_tokens": 4, "temperature": 0.7, "logprobs": 1},
            )
            for p in prompts
        ]
        seeded = [
            await _post(
                session, f"{url}/v1/completions", {"prompt": prompts[0], "max_tokens": 4, "temperature": 1.0, "seed": 7}
            )
            for _ in range(2)
        ]
        return health, outs, seeded

    health, outs, seeded = _run(talk, server)
    assert health["status"] == "ok" and health["policy_version"] == 0 and health["running"] == 0, health
    groups = []
    for prompt, (status, body) in zip(prompts, outs):
        assert status == 200, body
        assert len(body["choices"]) == 4 and body["usage"]["prompt_tokens"] == len(tok(prompt)["input_ids"])
        samples = []
        for c in body["choices"]:
            ext = c["nonstop"]
            assert ext["prompt_token_ids"] == tok(prompt)["input_ids"]
            assert 1 <= len(ext["token_ids"]) == len(ext["logprobs"]) == len(ext["policy_versions"]) <= 4
            assert set(ext["policy_versions"]) == {0}
            assert c["logprobs"]["token_logprobs"] == ext["logprobs"]
            assert c["text"] == tok.decode(ext["token_ids"], skip_special_tokens=True)
            assert c["finish_reason"] in ("stop", "length")
            samples.append(sample_from_extension(ext, c["finish_reason"]))
        groups.append(samples)
    d0 = abs_log_ratios(load_model(str(shipped_dir())), as_groups(groups), 0.7)
    print(f"serve --engine vllm, depth 0: {d0.numel()} tokens, mean |log ratio| {d0.mean():.2e}, max {d0.max():.2e}")
    assert d0.mean() < MEAN_ABS_LOG_RATIO and d0.max() < MAX_ABS_LOG_RATIO
    (s1, b1), (s2, b2) = seeded
    assert s1 == s2 == 200
    assert b1["choices"][0]["nonstop"]["token_ids"] == b2["choices"][0]["nonstop"]["token_ids"], "a seed repeats"


def test_streamed_chat_and_the_python_client(server):
    async def talk(session, url):
        chunks = []
        body = {
            "messages": [{"role": "user", "content": "12+34="}],
            "max_tokens": 5,
            "temperature": 1.0,
            "n": 2,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    chunks.append(line[6:])
        client = HttpClient(url, model=shipped_dir().name)
        try:
            samples = await client.complete([5, 6, 7], SamplingParams(3, 0.0))
        finally:
            await client.close()
        return chunks, samples

    chunks, samples = _run(talk, server)
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] >= 2
    streamed: dict[int, list[int]] = {0: [], 1: []}
    final: dict[int, dict] = {}
    for e in events[:-1]:
        [c] = e["choices"]
        assert e["object"] == "chat.completion.chunk"
        if c["finish_reason"] is None:
            streamed[c["index"]] += c["nonstop"]["token_ids"]
            assert c["nonstop"]["policy_versions"] == [0]
        else:
            final[c["index"]] = c["nonstop"]
    for i in (0, 1):  # the tokens streamed one by one are the completion returned at the end
        assert streamed[i] == final[i]["token_ids"] and len(final[i]["logprobs"]) == len(streamed[i]) >= 1
    assert len(samples) == 1 and 1 <= len(samples[0].completion_ids) <= 3 and set(samples[0].versions) == {0}


def test_what_the_vllm_engine_cannot_do_is_a_400_naming_it(server):
    async def talk(session, url):
        truncated = await _post(session, f"{url}/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "top_k": 5})
        nucleus = await _post(session, f"{url}/v1/completions", {"prompt": "1+1=", "max_tokens": 2, "top_p": 0.5})
        vocab = await _post(session, f"{url}/v1/completions", {"prompt": [1, 10**6], "max_tokens": 2})
        too_long = await _post(session, f"{url}/v1/completions", {"prompt": [1, 2], "max_tokens": 10**6})
        async with session.get(f"{url}/health") as r:
            health = await r.json()
        fine = await _post(session, f"{url}/v1/completions", {"prompt": "1+1=", "max_tokens": 2})
        return truncated, nucleus, vocab, too_long, health, fine

    truncated, nucleus, vocab, too_long, health, fine = _run(talk, server)
    for status, body in (truncated, nucleus):
        assert status == 400, body
        assert "truncated sampling is refused by the vllm engine" in body["error"]["message"], body
        assert "Keep Sampling Mask" in body["error"]["message"]
    assert vocab[0] == 400 and "vocabulary" in vocab[1]["error"]["message"], vocab
    assert too_long[0] == 400 and too_long[1]["error"]["param"] == "max_tokens", too_long  # vLLM's max_model_len
    assert health["status"] == "ok" and health["running"] == 0 and health["waiting"] == 0
    assert fine[0] == 200, fine  # refused requests never reached vLLM; it goes on serving
