"""A real model's trainer step: padded or packed forward, eager or compiled layers, side by side.

SmolLM2-135M-Instruct (`nonstop model fetch smollm2`, or --model DIR) in the trainer's precision
(bf16 where this CPU has it), one torch thread, lr as the run resolves it. The batch is the
recipe's shape: 8 prompts of examples/smollm2/train.jsonl rendered through the model's chat
template, 8 completions each of 10-64 tokens (the lengths the base answers in; random token ids,
since the step's cost does not depend on which tokens). Four arms, each a `TrainerWorker.step`
(forward, loss, backward, clip, AdamW, bf16 cast of the weights), one after another in this
process:

- padded:          trainer.packed false, trainer.compile false (the shared-prompt forward, eager);
- padded+compile:  the same with the layers' halves compiled (trainer/layer.py);
- packed:          the padding-free forward (trainer/packed.py), eager;
- packed+compile:  both, what a loaded model of this size resolves to;
- whole-prompts:   packed+compile with trainer.shared_prefix false: every prompt packed whole, its
                   24-token head (the template's system turn) not shared across the 8 groups.

The packed arms share the prompts' common head (trainer.shared_prefix, on by default); before it
existed they packed every prompt whole, as whole-prompts does.

Each arm takes --warmup steps first (the compiled arms compile there: their first step's time is
printed), then the median of --repeats timed steps, every arm on the same batches.

    python bench/trainer_step.py [--model DIR] [--repeats 5] [--warmup 2]

The last line is `RESULT padded_s=... packed_s=... compile_speedup_padded=... compile_speedup_packed=...
packed_speedup=... resolved_speedup=... first_compile_s=... shared_prefix_speedup=...` (resolved_speedup:
packed+compile over padded eager; shared_prefix_speedup: whole-prompts over packed+compile).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from nonstop.config import TrainerConfig, load_config
from nonstop.hf import load_model, load_tokenizer, quiet_transformers
from nonstop.models.gguf import model_cache
from nonstop.sizing.defaults import learning_rate
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import Group, Sample

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "padded": {"packed": False, "compile": False},
    "padded+compile": {"packed": False, "compile": True},
    "packed": {"packed": True, "compile": False},
    "packed+compile": {"packed": True, "compile": True},
    "whole-prompts": {"packed": True, "compile": True, "shared_prefix": False},
}
LENGTHS = (10, 14, 20, 30, 40, 64)


def batches(tok, count: int, seed: int) -> list[list[Group]]:
    rows = [json.loads(x) for x in (ROOT / "examples/smollm2/train.jsonl").read_text().splitlines() if x.strip()]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        groups = []
        for g in range(8):
            messages = rng.choice(rows)["messages"]
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
            samples = []
            for j in range(8):
                n = rng.choice(LENGTHS)
                ids = [rng.randrange(10, tok.vocab_size - 10) for _ in range(n)]
                samples.append(Sample(prompt, ids, [-2.0] * n, [0] * n, "stop", reward=float(j % 2)))
            groups.append(Group(g, "", "", samples))
        out.append(groups)
    return out


def run_arm(model: str, lr: float, fields: dict, data: list[list[Group]], warmup: int) -> tuple[float, list[float]]:
    cfg = TrainerConfig.model_validate({"lr": lr, "precision": "auto", **fields})
    worker = TrainerWorker(model, cfg, 1.0, 0)
    times = []
    for groups in data:
        t = time.perf_counter()
        worker.step(groups)
        times.append(time.perf_counter() - t)
    del worker
    gc.collect()
    return times[0], times[warmup:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the cached SmolLM2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(1)
    model = ns.model or str(model_cache() / "smollm2")
    tok = load_tokenizer(model)
    data = batches(tok, ns.warmup + ns.repeats, ns.seed)
    tokens = statistics.mean(sum(len(s.completion_ids) for g in b for s in g.samples) for b in data)
    params = sum(p.numel() for p in load_model(model).parameters())
    lr, _ = learning_rate(load_config(None, [f"model.path={model}"]), params)
    print(f"model {model}; lr {lr:.2g}; {tokens:.0f} completion tokens a batch; one thread", flush=True)
    median, first = {}, {}
    print("| arm | first step s | median step s | vs padded |\n|---|---|---|---|")
    for arm, fields in ARMS.items():
        first[arm], timed = run_arm(model, lr, fields, data, ns.warmup)
        median[arm] = statistics.median(timed)
        print(f"| {arm} | {first[arm]:.2f} | {median[arm]:.2f} | {median['padded'] / median[arm]:.2f}x |", flush=True)
    print(
        f"RESULT padded_s={median['padded']:.3f} packed_s={median['packed']:.3f} "
        f"compile_speedup_padded={median['padded'] / median['padded+compile']:.3f} "
        f"compile_speedup_packed={median['packed'] / median['packed+compile']:.3f} "
        f"packed_speedup={median['padded'] / median['packed']:.3f} "
        f"resolved_speedup={median['padded'] / median['packed+compile']:.3f} "
        f"first_compile_s={first['packed+compile'] - median['packed+compile']:.1f} "
        f"shared_prefix_speedup={median['whole-prompts'] / median['packed+compile']:.3f}"
    )


if __name__ == "__main__":
    main()
