"""Group admission on a heavy tail: this tree's scheduler against the one of another git revision.

The engine reserves each admitted sequence's KV tokens (prompt + max_new_tokens). Until the tenth
session a group gave its reservation back only when its last sibling ended, so on a heavy tail
one long sibling held the tokens of n - 1 idle slots and waiting groups could not join; now each
sequence gives its share back when it ends (engine/scheduler.py). This bench runs the same
seeded requests through both: `--groups` prompts of the long-rollout task (its shipped base and
BPE, 8 completions each, up to 1,024 new tokens, temperature 1, one seed per request) on an
engine of 64 slots x 1,088 tokens, and counts rows per forward pass while groups were waiting,
forward passes, and wall seconds. The samples are the same on both sides (seeded), so the rows
and passes are exact; the seconds are one noisy run each.

    python bench/group_admission.py [--groups 120] [--against 7783859]

Last line: RESULT rows_waiting_old=... rows_waiting_new=... passes_ratio=<new / old> time_ratio=<new / old>
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from nonstop.config import EngineConfig, TaskConfig
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.shipped import ASSETS, TASK_BASES
from nonstop.tasks.data import load_task
from nonstop.types import GenerationRequest, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def scheduler_at(rev: str, folder: Path):
    """engine/scheduler.py as it was at git revision `rev`, loaded as a module."""
    text = subprocess.run(
        ["git", "show", f"{rev}:src/nonstop/engine/scheduler.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = folder / "scheduler_at_rev.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("scheduler_at_rev", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Scheduler


def run(base: str, prompts: list[list[int]], eos: int, pad: int, scheduler=None) -> dict:
    eng = TorchEngine(load_model(base), [eos], pad, settings=EngineConfig(max_concurrent_seqs=64, max_seq_len=1088))
    if scheduler is not None:
        eng.scheduler = scheduler(eng.runner, [eos], eng.settings, eng.gate, None, 0)
    done: list = []
    for i, p in enumerate(prompts):
        eng.submit(GenerationRequest(i, p, 8, SamplingParams(1024, 1.0, seed=i)), done.append)
    passes = waiting_passes = waiting_rows = 0
    t0 = time.perf_counter()
    while eng.has_work():
        passes += 1
        if eng.scheduler.waiting:
            waiting_passes += 1
            waiting_rows += len(eng.scheduler.rows)
        eng.step()
    return {
        "s": time.perf_counter() - t0,
        "passes": passes,
        "rows_waiting": waiting_rows / max(waiting_passes, 1),
        "tokens": sum(len(s.completion_ids) for g in done for s in g),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, default=120)
    ap.add_argument("--against", default="7783859", help="git revision whose scheduler is the old side")
    ns = ap.parse_args()
    torch.set_num_threads(1)
    base = str(ASSETS / TASK_BASES["long_rollout"])
    tok = load_tokenizer(base)
    data = load_task(TaskConfig(name="long_rollout", eval_size=100), seed=0)
    prompts = [tok(e.prompt)["input_ids"] for e in data.train[: ns.groups]]
    with tempfile.TemporaryDirectory() as folder:
        old = run(base, prompts, tok.eos_token_id, tok.pad_token_id, scheduler_at(ns.against, Path(folder)))
    new = run(base, prompts, tok.eos_token_id, tok.pad_token_id)
    assert old["tokens"] == new["tokens"], "the seeded samples differ between the two schedulers"
    print(f"{ns.groups} groups of 8, {new['tokens']:,} tokens")
    print("| scheduler | rows a pass while groups waited | forward passes | seconds |")
    print("|---|---|---|---|")
    for name, r in ((f"{ns.against} (a group's reservation held to its end)", old), ("this tree", new)):
        print(f"| {name} | {r['rows_waiting']:.1f} | {r['passes']:,} | {r['s']:.1f} |")
    print(
        f"RESULT rows_waiting_old={old['rows_waiting']:.1f} rows_waiting_new={new['rows_waiting']:.1f} "
        f"passes_ratio={new['passes'] / old['passes']:.3f} time_ratio={new['s'] / old['s']:.3f}"
    )


if __name__ == "__main__":
    main()
