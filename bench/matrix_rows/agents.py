"""The rows with agents over the API: a two-turn chat agent with a calculator tool (tokens exact
across turns) and examples/api_agent/agent.py unchanged; both check that the tokens trained are
the tokens the endpoint recorded."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from matrix_rows.common import TRAIN_ROWS, Ctx, Row, RowFailed, base_row, steps_of, tail, train
from support import PYTHONPATH, api_agent_command


def completions_crc(groups: list[dict]) -> int:
    """completions_crc32 (the run's step record) of the groups the endpoint recorded (agents/groups.jsonl)."""
    from nonstop.orchestrator.records import completions_crc32

    groups_as_recorded: Any = [
        SimpleNamespace(
            epoch=0,
            prompt_index=g["index"],
            samples=[SimpleNamespace(completion_ids=e["completion_ids"]) for e in g["episodes"]],
        )
        for g in groups
    ]
    return completions_crc32(groups_as_recorded)


def recorded_groups(run_dir: Path) -> dict[int, dict]:
    path = run_dir / "agents" / "groups.jsonl"
    return {g["index"]: g for g in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def steps_match_recorded(run_dir: Path) -> tuple[bool, str]:
    recorded = recorded_groups(run_dir)
    steps = steps_of(run_dir)
    same = [
        r["completions_crc32"] == completions_crc([recorded[i] for _, i in r["prompts"]])
        for r in steps
        if all(i in recorded for _, i in r["prompts"])
    ]
    ok = len(same) == len(steps) > 0 and all(same)
    return ok, f"{sum(same)}/{len(steps)} steps' completions_crc32 == the recorded groups' ({len(recorded)} groups)"


def endpoint(run_dir: Path, proc: subprocess.Popen, wait_s: float = 900) -> dict:
    path = run_dir / "endpoint.json"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass
        time.sleep(0.5)
    raise RowFailed("the run never wrote endpoint.json")


TOOL_SYSTEM = (
    "You have a calculator. To use it, reply with only CALC(<expression>), for example CALC(7 * 8). "
    "After its result, reply with the answer."
)
CALL = re.compile(r"CALC\(\s*([0-9+\-*/ ]+?)\s*\)")


def calculator(expression: str) -> str:
    """The tool: + - * of small integers (anything else is refused, never evaluated)."""
    m = re.fullmatch(r"\s*(\d{1,3})\s*([+\-*])\s*(\d{1,3})\s*", expression)
    if not m:
        return "error: expected a op b"
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


async def tool_agent(base_url: str, model: str, group_size: int, rows: list[dict], report: dict) -> None:
    """Two-turn episodes with a calculator tool over chat/completions (the model's chat template),
    the official openai client: turn 1 answers the question (a CALC(...) call runs it, otherwise
    the tool checks the question's own expression), the tool's result goes back as a `tool`
    message, turn 2 answers. Reward: the last number of the last reply against the answer. Every
    turn's `nonstop` extension is kept to check the ids across turns."""
    import httpx
    from openai import APIConnectionError, APIStatusError, AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0)
    finished = asyncio.Event()
    report.update(episodes=[], statuses=[], failed=0)

    async def episode(gid: str, row: dict) -> None:
        eid = uuid.uuid4().hex
        tags = {"X-Episode-Id": eid, "X-Group-Id": gid}
        messages = [{"role": "system", "content": TOOL_SYSTEM}, *row["messages"]]
        turns = []
        try:
            for turn in range(2):
                raw = await client.chat.completions.with_raw_response.create(
                    model=model, messages=messages, max_tokens=24, temperature=1.0, extra_headers=tags
                )
                report["statuses"].append(raw.status_code)
                out = raw.parse()
                choice = out.choices[0]
                turns.append((choice.model_extra or {}).get("nonstop") or {})
                text = choice.message.content or ""
                messages.append({"role": "assistant", "content": text})
                if turn == 0:
                    call = CALL.search(text)
                    expression = (
                        call.group(1) if call else re.sub(r"[^0-9+*\- ]", "", row["messages"][-1]["content"]).strip()
                    )
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": f"call-{eid[:8]}",
                            "content": f"CALC({expression}) = {calculator(expression)}",
                        }
                    )
            numbers = re.findall(r"-?\d+", messages[-1]["content"])
            reward = float(bool(numbers) and numbers[-1] == row["answer"])
            r = await client.post(f"/episodes/{eid}/reward", body={"reward": reward}, cast_to=httpx.Response)
            report["statuses"].append(r.status_code)
            report["episodes"].append({"episode_id": eid, "turns": turns})
        except APIStatusError as e:
            # the run's end: a turn refused because it finished training, or a reward for an episode
            # whose group the run dropped as it ended (`run_ended`), as examples/api_agent/agent.py reads it
            if e.status_code == 409 and ("finished" in str(e.message) or "run_ended" in str(e.message)):
                finished.set()
                return
            report["failed"] += 1
            report["statuses"].append(e.status_code)
            report["last_error"] = str(e)[:300]
        except APIConnectionError:  # the run finished and closed its endpoint while this episode played
            report["cut_at_end"] = report.get("cut_at_end", 0) + 1
            finished.set()

    async def groups(k: int) -> None:
        i = k
        while not finished.is_set():
            gid = uuid.uuid4().hex
            await asyncio.gather(*(episode(gid, rows[i % len(rows)]) for _ in range(group_size)))
            i += 2
            if report["failed"] > 8:
                raise RowFailed(f"{report['failed']} failed episodes, the last: {report.get('last_error')}")

    await asyncio.gather(groups(0), groups(1))


def turns_exact(episodes: list[dict], recorded: dict[int, dict]) -> tuple[bool, str]:
    """Each turn's prompt ids begin with the previous turn's prompt + sampled ids, token for token,
    and every recorded episode is its last turn's prompt + sampled ids with the sampled ids masked in."""
    by_id = {e["episode_id"]: e for g in recorded.values() for e in g["episodes"]}
    checked, bad = 0, []
    for ep in episodes:
        t = ep["turns"]
        if len(t) != 2 or not all("token_ids" in x for x in t):
            bad.append("turn without the nonstop extension")
            continue
        first = t[0]["prompt_token_ids"] + t[0]["token_ids"]
        if t[1]["prompt_token_ids"][: len(first)] != first:
            bad.append("turn 2's prompt does not start with turn 1's ids")
        rec = by_id.get(ep["episode_id"])
        if rec is None:
            continue  # a group the run ended before handing to training
        whole = t[1]["prompt_token_ids"] + t[1]["token_ids"]
        sampled = [i for i, m in zip(rec["completion_ids"], rec["loss_mask"]) if m]
        if rec["prompt_ids"] + rec["completion_ids"] != whole or sampled != t[0]["token_ids"] + t[1]["token_ids"]:
            bad.append("recorded episode differs from the sampled ids")
        checked += 1
    return checked > 0 and not bad, f"{checked} trained two-turn episodes exact across turns" + (
        f"; {bad[:2]}" if bad else ""
    )


def agents_run(
    ctx: Ctx, name: str, extra: dict[str, object], agent: Callable[[Path, subprocess.Popen], object]
) -> tuple[dict, Path, object]:
    """A training run with agents.enabled and `agent(run_dir, proc)` playing against it. An agent
    that stops while the run still waits for episodes (it failed) ends the run with Ctrl-C."""
    run_dir = ctx.folder / "runs" / name
    holder: dict = {}

    def watch(proc: subprocess.Popen) -> None:
        try:
            holder["agent"] = agent(run_dir, proc)
        except BaseException as e:  # reported in the row
            holder["error"] = e
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            holder.setdefault("error", RowFailed("the agent stopped and the run still waited for episodes"))
            proc.send_signal(signal.SIGINT)

    # an episode is several turns: room for the prompt, the turns and what the agent adds between them
    extra = {
        "agents.enabled": "true",
        "agents.linger_s": 2,
        "agents.episode_timeout_s": 600,  # a loaded machine's slow group is not abandoned
        "engine.max_seq_len": 320,
        "rollout.prompts_per_step": 2,  # two groups of episodes a step: the agent plays them as they go
        **extra,
    }
    try:
        summary, run_dir, _ = train(ctx, name, extra, watch=watch)
    except RowFailed as e:
        raise RowFailed(f"agent: {holder['error']!r}"[:400] if "error" in holder else str(e)) from None
    if "error" in holder:
        raise RowFailed(f"agent: {holder['error']!r}"[:400])
    return summary, run_dir, holder.get("agent")


def row_multiturn_tool(ctx: Ctx) -> Row:
    rows = [json.loads(x) for x in TRAIN_ROWS.read_text().splitlines() if '"*"' in x][::7]

    def agent(run_dir: Path, proc: subprocess.Popen) -> dict:
        ep = endpoint(run_dir, proc)
        report: dict = {}
        asyncio.run(tool_agent(ep["base_url"], ep["model"], ep["group_size"], rows, report))
        return report

    summary, run_dir, report = agents_run(ctx, "multiturn_tool", {}, agent)
    assert isinstance(report, dict)
    exact, exact_text = turns_exact(report["episodes"], recorded_groups(run_dir))
    crc_ok, crc_text = steps_match_recorded(run_dir)
    statuses = report["statuses"]
    ok_http = bool(statuses) and all(200 <= s < 300 for s in statuses)
    text = f"{exact_text}; {crc_text}; {len(statuses)} HTTP answers, all 2xx: {ok_http}"
    if not ok_http:
        text += f" ({sorted(set(statuses))}, the last error: {report.get('last_error')})"
    return base_row(
        "multi-turn env with a tool, chat template, tokens exact", summary, run_dir, exact and crc_ok and ok_http, text
    )


def row_api_agent(ctx: Ctx) -> Row:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}

    def agent(run_dir: Path, proc: subprocess.Popen) -> dict:
        done = subprocess.run(
            api_agent_command(run_dir, groups_in_flight=2, eval_rows=4, max_s=900, wait_s=900),
            cwd=ctx.folder,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RowFailed(f"agent.py exited {done.returncode}: {tail(done.stderr)}")
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
        return json.loads(line[7:])

    extra = {
        "env.name": "guess_number",
        "env.max_turns": 3,
        "env.turn_max_tokens": 2,
        "env.max_episode_tokens": 32,
        "env.eval_rows": 4,
    }
    summary, run_dir, result = agents_run(ctx, "api_agent", extra, agent)
    assert isinstance(result, dict)
    crc_ok, crc_text = steps_match_recorded(run_dir)
    clean = result.get("failed_episodes", 1) == 0 and result.get("stopped_by") == "run finished training"
    text = f"examples/api_agent/agent.py (openai client): {result.get('groups')} groups, "
    text += f"{result.get('failed_episodes')} failed episodes; {crc_text}"
    return base_row("agents over the API, official openai client", summary, run_dir, crc_ok and clean, text)
