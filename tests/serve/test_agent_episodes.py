"""Agents' episodes recorded server-side (serve/recorder.py) over real HTTP on 127.0.0.1: the
recorded tokens, and the faults of the agent path (duplicate rewards, unknown ids, divergent
history, abandoned episodes, a killed client, the open-episode cap)."""

import asyncio
import json
import subprocess
import sys
import textwrap

import aiohttp
import pytest

from nonstop.config import EngineConfig
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.serve.recorder import EpisodeRecorder
from nonstop.serve.server import EngineServer
from support import child_env

NAME = "tiny-agents"


def _run(tiny_dir, body, group_size=2, timeout_s=60.0, max_open=8):
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
        dropped = asyncio.Event()
        rec = EpisodeRecorder(tok, group_size, timeout_s, max_open, on_drop=lambda msg: dropped.set())
        server = EngineServer(aio, tok, NAME, recorder=rec)
        port = await server.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                return await body(f"http://127.0.0.1:{port}", s, rec, tok, dropped)
        finally:
            await server.stop()
            await aio.close()

    return asyncio.run(main())


async def _post(s, url, body, eid=None, gid=None):
    headers = {}
    if eid is not None:
        headers["X-Episode-Id"] = eid
    if gid is not None:
        headers["X-Group-Id"] = gid
    async with s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json()


def _turn(prompt, temperature=1.0, max_tokens=3):
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}


def test_recorded_episode_is_the_engines_tokens_plus_the_agents_text(tiny_dir):
    async def body(url, s, rec, tok, dropped):
        expected = {}
        for eid in ("e1", "e2"):
            st, out = await _post(s, url + "/v1/completions", _turn("12+"), eid, "g1")
            assert st == 200, out
            c1 = out["choices"][0]
            prompt = c1["nonstop"]["prompt_token_ids"]
            assert prompt == tok("12+")["input_ids"]
            # the episode's second turn: the transcript as returned, plus the environment's text
            text2 = "12+" + c1["text"] + "=7"
            st, out = await _post(s, url + "/v1/completions", _turn(text2), eid, "g1")
            assert st == 200, out
            c2 = out["choices"][0]
            env = tok("=7", add_special_tokens=False)["input_ids"]
            assert c2["nonstop"]["prompt_token_ids"] == prompt + c1["nonstop"]["token_ids"] + env
            expected[eid] = (prompt, c1["nonstop"], env, c2["nonstop"])
            st, got = await _get(s, f"{url}/v1/episodes/{eid}")
            assert st == 200 and got["state"] == "open" and got["turns"] == 2
        # the first reward does not complete the group; the second does
        st, out = await _post(s, url + "/v1/episodes/e1/reward", {"reward": 1.0})
        assert st == 200 and out["group_complete"] is False and rec.ready.empty()
        st, out = await _post(s, url + "/v1/episodes/e2/reward", {"reward": 0.0})
        assert st == 200 and out["group_complete"] is True
        group = rec.ready.get_nowait()
        assert [smp.reward for smp in group.samples] == [1.0, 0.0] and group.prompt == "g1"
        for smp, eid in zip(group.samples, ("e1", "e2")):
            prompt, t1, env, t2 = expected[eid]
            assert smp.prompt_ids == prompt
            assert smp.completion_ids == t1["token_ids"] + env + t2["token_ids"]
            assert smp.loss_mask == [True] * len(t1["token_ids"]) + [False] * len(env) + [True] * len(t2["token_ids"])
            assert smp.logprobs == t1["logprobs"] + [0.0] * len(env) + t2["logprobs"]
            assert smp.versions == t1["policy_versions"] + [-1] * len(env) + t2["policy_versions"]
        # faults: a second reward (409), an unknown id (404), a turn of a rewarded episode (409)
        st, out = await _post(s, url + "/v1/episodes/e1/reward", {"reward": 1.0})
        assert st == 409 and "e1" in out["error"]["message"] and out["error"]["type"] == "conflict_error"
        st, out = await _post(s, url + "/v1/episodes/nope/reward", {"reward": 1.0})
        assert st == 404 and "nope" in out["error"]["message"]
        st, out = await _get(s, f"{url}/v1/episodes/nope")
        assert st == 404 and out["error"]["type"] == "not_found_error"
        st, out = await _post(s, url + "/v1/completions", _turn("12+"), "e1", "g1")
        assert st == 410 and "e1" in out["error"]["message"]
        st, out = await _post(s, url + "/v1/episodes/e2/reward", {"reward": "high"})
        assert st == 400 and out["error"]["param"] == "reward"
        assert rec.ready.empty() and not rec.episodes and not rec.groups  # nothing twice, nothing held
        rep = rec.report()
        assert rep["groups_delivered"] == 1 and rep["refused"]["duplicate_rewards"] == 1
        # requests without an episode id are served and not recorded
        st, out = await _post(s, url + "/v1/completions", _turn("1+1=", temperature=0))
        assert st == 200 and rec.report()["episodes_started"] == 2

    _run(tiny_dir, body)


async def _get(s, url):
    async with s.get(url) as r:
        return r.status, await r.json()


def test_divergent_history_and_chat_bridge(tiny_dir):
    async def body(url, s, rec, tok, dropped):
        st, out = await _post(s, url + "/v1/completions", _turn("12+"), "d1", "gd")
        assert st == 200
        st, out = await _post(s, url + "/v1/completions", _turn("99+" + out["choices"][0]["text"]), "d1", "gd")
        assert st == 400 and "d1" in out["error"]["message"] and "does not extend" in out["error"]["message"]
        assert rec.report()["refused"]["diverged"] == 1
        # a recorded request needs a group id; n must be 1
        st, out = await _post(s, url + "/v1/completions", _turn("1+"), "d2")
        assert st == 400 and out["error"]["param"] == "group_id"
        st, out = await _post(s, url + "/v1/completions", {**_turn("1+"), "n": 2}, "d2", "gd")
        assert st == 400 and out["error"]["param"] == "n"
        # chat: the body's episode_id / group_id fields (the openai client's extra_body) work like the headers
        msgs = [{"role": "user", "content": "3+4"}]
        st, out = await _post(
            s,
            url + "/v1/chat/completions",
            {"model": NAME, "messages": msgs, "max_tokens": 3, "episode_id": "c1", "group_id": "gc"},
        )
        assert st == 200, out
        c1 = out["choices"][0]
        msgs2 = [*msgs, {"role": "assistant", "content": c1["message"]["content"]}, {"role": "user", "content": "=7"}]
        st, out = await _post(
            s,
            url + "/v1/chat/completions",
            {"model": NAME, "messages": msgs2, "max_tokens": 3, "episode_id": "c1", "group_id": "gc"},
        )
        assert st == 200, out
        c2 = out["choices"][0]
        before = c1["nonstop"]["prompt_token_ids"] + c1["nonstop"]["token_ids"]
        bridge = c2["nonstop"]["prompt_token_ids"][len(before) :]
        assert c2["nonstop"]["prompt_token_ids"][: len(before)] == before  # never re-encoded
        assert tok.decode(bridge) == "\nuser: =7\nassistant: "  # only the new text, encoded alone

    _run(tiny_dir, body)


def test_abandoned_group_is_dropped_counted_and_freed(tiny_dir):
    async def body(url, s, rec, tok, dropped):
        st, _ = await _post(s, url + "/v1/completions", _turn("12+"), "a1", "ga")
        assert st == 200
        st, _ = await _post(s, url + "/v1/completions", _turn("12+"), "a2", "ga")
        st, _ = await _post(s, url + "/v1/episodes/a2/reward", {"reward": 1.0})
        assert st == 200
        await asyncio.wait_for(dropped.wait(), timeout=30)  # a1 never rewarded: its group times out
        rep = rec.report()
        assert rep["episodes_abandoned"] == 1 and rep["groups_dropped"] == 1 and rep["groups_delivered"] == 0
        assert not rec.episodes and not rec.groups and rec.ready.empty()
        st, out = await _post(s, url + "/v1/episodes/a1/reward", {"reward": 1.0})
        assert st == 409 and "dropped" in out["error"]["message"]
        assert rec.report()["refused"] == {"late_rewards": 1}  # not a duplicate: it was never rewarded

    _run(tiny_dir, body, timeout_s=0.5)


def test_open_episode_cap_refuses_with_429(tiny_dir):
    async def body(url, s, rec, tok, dropped):
        for i in range(2):
            st, _ = await _post(s, url + "/v1/completions", _turn("1+"), f"o{i}", "go")
            assert st == 200
        st, out = await _post(s, url + "/v1/completions", _turn("1+"), "o2", "gp")
        assert st == 429 and "max_open_episodes" in out["error"]["message"]
        # a full group refuses a third episode
        st, out = await _post(s, url + "/v1/completions", _turn("1+"), "o3", "go")
        assert st in (409, 429)

    _run(tiny_dir, body, max_open=2)


AGENT = textwrap.dedent(
    """
    import sys, time
    from openai import OpenAI
    client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
    out = client.completions.create(model="%s", prompt="12+", max_tokens=3,
                                    extra_headers={"X-Episode-Id": "k1", "X-Group-Id": "gk"})
    print("turn", out.choices[0].text, flush=True)
    time.sleep(600)
    """
    % NAME
)


def test_client_killed_mid_episode_is_dropped_and_the_server_goes_on(tiny_dir):
    async def body(url, s, rec, tok, dropped):
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", AGENT, url, stdout=subprocess.PIPE, env=child_env()
        )
        try:
            line = await asyncio.wait_for(child.stdout.readline(), timeout=60)
            assert line.startswith(b"turn")
            assert rec.describe("k1")["turns"] == 1
        finally:
            child.kill()
            await child.wait()
        await asyncio.wait_for(dropped.wait(), timeout=30)
        assert rec.report()["episodes_abandoned"] == 1 and not rec.episodes
        st, out = await _post(s, url + "/v1/completions", _turn("12+"), "k2", "gk2")  # the server goes on
        assert st == 200 and json.dumps(out)

    _run(tiny_dir, body, timeout_s=1.0)


@pytest.mark.parametrize("bad", ["", "x" * 201])
def test_bad_episode_ids_are_refused(tiny_dir, bad):
    async def body(url, s, rec, tok, dropped):
        st, out = await _post(s, url + "/v1/completions", {**_turn("1+"), "episode_id": bad or 5, "group_id": "g"})
        assert st == 400 and out["error"]["param"] in ("episode_id", "X-Episode-Id")

    _run(tiny_dir, body)
