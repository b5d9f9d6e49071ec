"""nonstop vs TRL's synchronous GRPOTrainer, side by side in one invocation.

Same initial weights (a 3.05 M-parameter Qwen2: hidden 256, 4 layers, char vocab of 128, made
on the fly and saved once), same task (two-operand addition) and exact-match reward, 16
completions (2 prompts x 8) of at most 64 new tokens per step. Arms:

- trl:      trl.GRPOTrainer (bf16=False, use_cpu=True, gradient_checkpointing=False), one
            process with torch's default threads (both cores); trl1: the same with one thread
            (on a busy machine two threads spin and can be several times slower); the better
            TRL arm is the baseline;
- nonstop:  depth 0 (synchronous), depth 1 and depth 2, engine and trainer processes with one
            thread each, filter_uniform_reward off so every generated sample is trained on.

Any arm name with the suffix `-bf16` runs the same arm in bfloat16 where each side allows it: TRL
with `bf16=True` (torch.autocast on the CPU, fp32 master weights), nonstop with
`engine.dtype=bfloat16` and `trainer.precision=bfloat16` (autocast, fp32 master weights and AdamW).
TRL's best configuration is the best of every TRL arm run, in either precision; a CPU without bf16
computes the bf16 arms in emulation (slow), so leave them out there.

Each arm runs in its own subprocess; samples/s counts completions consumed by the trainer per
second in steady state (from the end of the first step to the end of the last). Trainer idle
is the fraction of that wall time the trainer was not computing (for TRL: time in generation).

    python bench/vs_trl.py [--steps 40] [--arms trl,trl1,depth0,depth1,depth2,trl-bf16,depth2-bf16]
    # needs the bench extra: pip install -e .[bench]

The last line is `RESULT best_ratio_vs_trl=<best nonstop arm's samples/s / the best TRL arm's>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS, GROUP, MAX_NEW = 2, 8, 64


def make_model(path: Path) -> int:
    from nonstop.config import TinyModelConfig
    from nonstop.models.tiny import count_parameters, make_char_tokenizer, make_tiny_model

    cfg = TinyModelConfig(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=640, max_position_embeddings=128
    )
    model = make_tiny_model(cfg, seed=0)
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return count_parameters(model)


def run_trl(model_dir: str, steps: int, out: str, threads: int | None = None, bf16: bool = False) -> dict:
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from nonstop.config import TaskConfig
    from nonstop.tasks.data import load_task
    from trl_common import answer_dataset, exact_match_reward, grpo_config, step_ends

    data = load_task(TaskConfig(), seed=0)
    args = grpo_config(
        out,
        steps,
        bf16,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=MAX_NEW,
        learning_rate=3e-4,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=exact_match_reward,
        args=args,
        train_dataset=answer_dataset(data.train[: PROMPTS * (steps + 2)]),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    ends = step_ends(trainer)  # perf_counter at the end of each step
    gen_s = [0.0]
    inner = trainer._generate_and_score_completions

    def timed(*a, **kw):  # a timer around TRL's own generation step, to split gen vs train time
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            if ends:  # steady state only: after the first step
                gen_s[0] += time.perf_counter() - t0

    setattr(trainer, "_generate_and_score_completions", timed)  # the same whether trl is typed here or not
    trainer.train()
    wall = ends[-1] - ends[0]
    return {
        "samples_per_s": PROMPTS * GROUP * (len(ends) - 1) / wall,
        "trainer_idle": gen_s[0] / wall,
        "steps": len(ends),
        "threads": torch.get_num_threads(),
    }


def run_nonstop(model_dir: str, steps: int, depth: int, out: str, bf16: bool = False) -> dict:
    from rich.console import Console

    from nonstop.cli import run_training
    from nonstop.config import load_config

    cfg = load_config(
        overrides=[
            f"model.path={model_dir}",
            "warmup.enabled=false",
            f"buffer.depth={depth}",
            f"buffer.max_lag={max(depth, 1)}",
            f"rollout.prompts_per_step={PROMPTS}",
            f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={MAX_NEW}",
            "rollout.filter_uniform_reward=false",
            "trainer.lr=3e-4",
            f"run.max_steps={steps}",
            "run.max_time_s=null",
            f"run.eval_every={10**6}",
            "task.eval_size=16",
            f"run.out_dir={out}",
            "run.name=run",
            "run.progress=off",
            *(["engine.dtype=bfloat16", "trainer.precision=bfloat16"] if bf16 else []),
        ]
    )
    run_training(cfg, Console(quiet=True))
    recs = [json.loads(x) for x in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = recs[0], recs[-1]
    wall = last["time_s"] - first["time_s"]
    trained = sum(r["samples_trained"] for r in recs[1:])
    train_busy = last["training_busy_s"] - first["training_busy_s"]
    return {
        "samples_per_s": trained / wall,
        "trainer_idle": max(0.0, 1 - train_busy / wall),
        "steps": len(recs),
        "threads": "1 per process",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--arms", default="trl,trl1,depth0,depth1,depth2", help="comma-separated subset of arms")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.arm:  # child: run one arm, print its JSON on the last line
        arm, _, dtype = ns.arm.partition("-")
        bf16 = dtype == "bf16"
        with tempfile.TemporaryDirectory() as out:
            if arm.startswith("trl"):
                res = run_trl(ns.model, ns.steps, out, 1 if arm == "trl1" else None, bf16)
            else:
                res = run_nonstop(ns.model, ns.steps, int(arm[-1]), out, bf16)
        print(json.dumps(res))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "qwen2-3m"
        n_params = make_model(model_dir)
        print(
            f"model: Qwen2, {n_params / 1e6:.2f} M parameters; {PROMPTS} prompts x {GROUP} completions x "
            f"<= {MAX_NEW} new tokens per step; {ns.steps} steps per arm",
            flush=True,
        )
        results = {}
        for arm in ns.arms.split(","):
            env = {
                **os.environ,
                "TRANSFORMERS_VERBOSITY": "error",
                "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"),
            }
            proc = subprocess.run(
                [sys.executable, __file__, "--arm", arm, "--model", str(model_dir), "--steps", str(ns.steps)],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                print(f"{arm}: failed\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}", flush=True)
                continue
            results[arm] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  {arm}: {results[arm]}", flush=True)
    trl = [r["samples_per_s"] for a, r in results.items() if a.startswith("trl")]
    base = max(trl) if trl else None
    print(f"\n{'arm':<22}{'samples/s':>10}{'trainer idle':>14}{'vs TRL':>9}")
    names = {
        "trl": "TRL GRPOTrainer",
        "trl1": "TRL, 1 thread",
        "depth0": "nonstop depth 0",
        "depth1": "nonstop depth 1",
        "depth2": "nonstop depth 2",
    }
    for arm, r in results.items():
        ratio = f"{r['samples_per_s'] / base:.2f}x" if base else "-"
        name, _, dtype = arm.partition("-")
        label = names[name] + (", bf16" if dtype else "")
        print(f"{label:<22}{r['samples_per_s']:>10.1f}{r['trainer_idle']:>13.0%}{ratio:>9}")
    ours = [a for a in results if a.startswith("depth")]
    if not (base and ours):
        print("RESULT best_ratio_vs_trl=nan")
        return
    best = max(ours, key=lambda a: results[a]["samples_per_s"])
    best_trl = max((a for a in results if a.startswith("trl")), key=lambda a: results[a]["samples_per_s"])
    ratio = results[best]["samples_per_s"] / base
    print(f"RESULT best_ratio_vs_trl={ratio:.2f} best_arm={best} best_trl_arm={best_trl}")


if __name__ == "__main__":
    main()
