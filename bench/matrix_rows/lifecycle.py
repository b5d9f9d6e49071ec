"""The rows after training: distillation from a teacher nonstop trained, `nonstop serve` on that
model, and `--resume` after a SIGKILL, exact against an uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from matrix_rows.common import SMALL, Ctx, Row, RowFailed, base_row, cli, steps_of, tail, train
from support import PYTHONPATH
from support.faults import DEAD, await_state, proved_killed_trainer_resumed, verified


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
