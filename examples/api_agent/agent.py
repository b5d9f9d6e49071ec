"""An agent outside nonstop that trains the run's policy through its OpenAI-compatible endpoint.

It uses the official `openai` client only (nothing of nonstop is imported) and plays a
multi-turn game: guess a hidden number in 1..7 in at most 3 guesses; after each guess the agent
(the game's host) answers '<' (lower), '>' (higher), '=' (found) or '!' (not a guess). The
conversation is plain text: '?', then per turn the model's guess and the host's answer.

1. It finds the endpoint in RUN_DIR/endpoint.json (written by `nonstop train` with
   `agents.enabled`), and measures the policy's held-out success rate at temperature 0 with
   requests that carry no episode id (served, never trained).
2. It plays groups of `group_size` episodes (the run's rollout.group_size) under an episode id
   and a group id (headers X-Episode-Id / X-Group-Id), each turn's prompt being the transcript
   so far (the completion text exactly as returned, plus the host's answer), and posts each
   episode's reward (1 - 0.1 x (guesses - 1) when found, else 0) to /v1/episodes/{id}/reward.
   It stops when the run says it finished training (409 on a recorded request) or after
   --max-seconds.
3. It measures the held-out success rate again and prints one line:
   RESULT {"base": ..., "final": ..., "gain_points": ..., ...}

    python examples/api_agent/agent.py --run-dir runs/api_agent
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from pathlib import Path

import httpx
from openai import APIConnectionError, APIStatusError, AsyncOpenAI

HIGH, MAX_TURNS, TURN_TOKENS = 7, 3, 2


class RunFinished(Exception):
    """The endpoint refused a recorded request: the run finished training."""


def ended(e: APIStatusError) -> bool:
    """The run's refusal once it finished training (409), for a turn or for a reward."""
    return e.status_code == 409 and ("finished training" in e.message or "run_ended" in e.message)


def answer(guess_text: str, hidden: int) -> str:
    g = guess_text.strip()
    if not (g.isdigit() and 1 <= int(g) <= HIGH):
        return "!"
    return "=" if int(g) == hidden else ("<" if hidden < int(g) else ">")


async def play(
    client: AsyncOpenAI, model: str, hidden: int, temperature: float, tags: dict | None
) -> tuple[float, int]:
    """One episode: (reward, newest policy version seen). `tags`: the episode's headers, or None (not recorded)."""
    transcript, newest = "?", -1
    for turn in range(1, MAX_TURNS + 1):
        try:
            out = await client.completions.create(
                model=model,
                prompt=transcript,
                max_tokens=TURN_TOKENS,
                temperature=temperature,
                extra_headers=tags or {},
            )
        except APIStatusError as e:
            if tags is not None and ended(e):
                raise RunFinished from None
            raise
        choice = out.choices[0]
        ext = (choice.model_extra or {}).get("nonstop") or {}
        newest = max([newest, *ext.get("policy_versions", [])])
        reply = answer(choice.text, hidden)
        transcript += choice.text + reply
        if reply == "=":
            return 1.0 - 0.1 * (turn - 1), newest
    return 0.0, newest


async def held_out(client: AsyncOpenAI, model: str, numbers: list[int]) -> float:
    """Success rate at temperature 0 over the held-out hidden numbers (no episode id: not trained)."""
    results = await asyncio.gather(*(play(client, model, h, 0.0, None) for h in numbers))
    return sum(r > 0 for r, _ in results) / len(numbers)


async def train(client: AsyncOpenAI, model: str, group_size: int, groups_in_flight: int, max_s: float) -> dict:
    rng = random.Random(0)
    stats = {"groups": 0, "episodes": 0, "reward_sum": 0.0, "newest_version": 0, "failed_episodes": 0}
    deadline = time.monotonic() + max_s
    finished = asyncio.Event()

    async def episode(gid: str, hidden: int) -> None:
        eid = uuid.uuid4().hex
        try:
            reward, newest = await play(client, model, hidden, 1.0, {"X-Episode-Id": eid, "X-Group-Id": gid})
            await client.post(f"/episodes/{eid}/reward", body={"reward": reward}, cast_to=httpx.Response)
        except RunFinished:
            finished.set()
            return
        except APIStatusError as e:
            if ended(e):
                finished.set()
                return
            stats["failed_episodes"] += 1
            raise
        except APIConnectionError:  # this episode is lost; the run drops its group, counted
            stats["failed_episodes"] += 1
            if finished.is_set() or time.monotonic() > deadline:
                return
            raise
        stats["episodes"] += 1
        stats["reward_sum"] += reward
        stats["newest_version"] = max(stats["newest_version"], newest)

    async def groups() -> None:
        while not finished.is_set() and time.monotonic() < deadline:
            gid, hidden = uuid.uuid4().hex, rng.randint(1, HIGH)
            await asyncio.gather(*(episode(gid, hidden) for _ in range(group_size)))
            stats["groups"] += 1

    await asyncio.gather(*(groups() for _ in range(groups_in_flight)))
    stats["stopped_by"] = "run finished training" if finished.is_set() else "max seconds"
    return stats


def endpoint(run_dir: Path, wait_s: float) -> dict:
    path = run_dir / "endpoint.json"
    deadline = time.monotonic() + wait_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise SystemExit(f"no {path} after {wait_s:g} s: is `nonstop train` running with agents.enabled?")
        time.sleep(0.5)  # the run writes the file once its endpoint is up
    return json.loads(path.read_text())


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, required=True, help="the run folder (its endpoint.json)")
    ap.add_argument("--groups-in-flight", type=int, default=8)
    ap.add_argument("--max-seconds", type=float, default=600.0, help="stop training after this long at most")
    ap.add_argument("--eval-rows", type=int, default=70)
    ap.add_argument("--wait-s", type=float, default=600.0, help="how long to wait for the endpoint")
    ns = ap.parse_args()
    info = endpoint(ns.run_dir, ns.wait_s)
    client = AsyncOpenAI(base_url=info["base_url"], api_key="none", max_retries=0, timeout=120)
    held = [random.Random(1234).randint(1, HIGH) for _ in range(ns.eval_rows)]  # another seed than training
    t0 = time.monotonic()
    base = await held_out(client, info["model"], held)
    print(f"base held-out success (temperature 0): {base:.1%}", flush=True)
    stats = await train(client, info["model"], info["group_size"], ns.groups_in_flight, ns.max_seconds)
    final = await held_out(client, info["model"], held)
    print(f"final held-out success (temperature 0): {final:.1%}", flush=True)
    out = {
        "base": base,
        "final": final,
        "gain_points": round(100 * (final - base), 1),
        "train_s": round(time.monotonic() - t0, 1),
        **stats,
    }
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
