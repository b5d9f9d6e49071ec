"""The real-model recipe (examples/smollm2/recipe.yaml) against its synchronous self and TRL, read from curves.

Every arm starts from the same base, SmolLM2-135M-Instruct (`nonstop model fetch smollm2`), on the
same chat rows (examples/smollm2/train.jsonl), scored by the same reward (`last_number`) on the same
60 held-out questions, which no training row asks in any phrasing. Arms, one after another with
nothing else on the cores:

- async: the recipe as it is (buffer.depth 1, forward ahead): `nonstop train examples/smollm2/recipe.yaml`;
- sync:  the same with buffer.depth 0 (generate, then train, then generate again);
- trl:   TRL's GRPOTrainer on the same model, rows (TRL's conversational format, its own chat
         templating), reward (TRL's signature), learning rate (the one nonstop resolves for this
         model), batch (8 prompts x 8 completions), completion budget and temperature; bf16 where the
         CPU has it, as nonstop's arms; one process on both cores. It is evaluated exactly as
         nonstop's arms are (TRL's current weights copied into nonstop's built-in engine in the runs'
         dtype, greedy completions of the held-out prompts as nonstop renders them, last_number)
         before its first step and every 5 steps; the time those evaluations take is left out of its
         clock. (HF generate's own greedy batch, bf16 autocast and left padding, read the base 13
         points lower than the engine: an evaluator of its own would move TRL's target.)

Time to target is read from each arm's curve of held-out evaluations against RL seconds, evaluation
time left out in every arm (nonstop's from its span log). The nonstop arms run with
run.eval_pauses_generation, so that no arm generates during the time left out: without it the
sync arm's next batch was generated during each evaluation (its steps right after one took 12.5 s
against 20.6 s), about 5-10% of its time to target off its clock. The target is set above every arm's first
two evaluations (the base and the first after training), by TARGET_MARGIN, so it measures learning,
not the step rate. speedup_vs_sync = the sync arm's time to target / the async arm's, per seed;
the RESULT gives the median over seeds. ratio_vs_trl = TRL's time to target / the async arm's
(seed 0's; when TRL does not reach the target within its budget, its budget is used and
trl_reached=0 says so: the ratio is then a lower bound). The arm `default` runs one step with only
model.path and the task set (the default batch, 32 x 8, completions of up to the resolved 256 tokens;
--default-tokens 512 --default-steps 2 for more) and compares the run's peak memory (every process's
proportional set size together) with its own plan's total, and each process's peak unique set size
(shared pages such as the weight segment left out: the plan counts it once, apart) with what the
plan gives that process (default_batch_* keys). peak_rss_gib is the largest resident set of a nonstop run's
process tree (the sum of its processes' proportional set sizes, shared pages counted once),
sampled every second.

    python bench/real_model.py                    # seeds 0,1,2; arms async, sync, trl; 9.75 minutes each
    python bench/real_model.py --quick            # seed 0, 4 minutes an arm
    python bench/real_model.py --seeds 0 --arms async,trl --minutes 10
    python bench/real_model.py --arms default     # only model.path and the task: 32 x 8, one step
    # TRL comes with the bench extra: pip install -e '.[bench]'

The last line is `RESULT base=... final=... gain=... minutes=... samples_per_s=... tokens_per_s=...
speedup_vs_sync=... ratio_vs_trl=... peak_rss_gib=...` (async arm, median over seeds where a figure
is per seed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.cli import sets  # noqa: E402

RECIPE = ROOT / "examples" / "smollm2" / "recipe.yaml"
TARGET_MARGIN = 0.05
"""The target sits this far above the best of every arm's first two evaluations (3 of 60 questions)."""
TRL_EVAL_EVERY = 5
MAX_NEW_TOKENS = 64
"""The recipe's rollout.max_new_tokens, which TRL's arm generates and evaluates with too."""


def memory_by_process(pid: int) -> dict[str, tuple[int, int]]:
    """(proportional, unique) set size of each process of the tree under `pid`, by its title
    ('nonstop: engine-0') or command line. Proportional: shared pages (the weight segment) are split
    among the processes that map them, so the sum over processes is the memory the run holds,
    counted once. Unique: the pages only this process maps, what its own plan items predict."""
    import psutil  # type: ignore[import-untyped]  # ray's dependency, no stubs installed

    out: dict[str, tuple[int, int]] = {}
    try:
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            try:
                name = " ".join(p.cmdline())[:80]
                info = p.memory_full_info()
                out[name] = (info.pss, info.uss)
            except psutil.Error:  # a process that ended between the listing and the read
                continue
    except psutil.Error:
        pass
    return out


def rss_tree(pid: int) -> int:
    return sum(pss for pss, _ in memory_by_process(pid).values())


def run_nonstop(arm: str, seed: int, minutes: float, folder: Path, extra: list[str]) -> dict:
    name = f"{arm}-s{seed}"
    overrides = {
        "run.seed": seed,
        "run.max_total_s": f"{minutes * 60:g}",
        "run.out_dir": folder,
        "run.name": name,
        "run.progress": "plain",
        "checkpoint.every_steps": None,
        "run.eval_pauses_generation": True,  # nothing generated in the evaluation time the clock leaves out
    }
    cmd = [str(Path(sys.executable).parent / "nonstop"), "train", str(RECIPE), *sets(overrides), *sets(extra)]
    if arm == "sync":
        cmd += sets({"buffer.depth": 0})
    t0, peak = time.perf_counter(), 0
    with open(folder / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            peak = max(peak, rss_tree(proc.pid))
            time.sleep(1.0)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {folder / f'{name}.log'}")
    return read_nonstop(arm, seed, folder, (time.perf_counter() - t0) / 60, peak)


def read_nonstop(arm: str, seed: int, folder: Path, minutes: float, peak: int) -> dict:
    """One finished nonstop arm's row from its run folder (`--reuse` reads earlier runs this way)."""
    name = f"{arm}-s{seed}"
    run_dir = folder / name
    summary = json.loads((run_dir / "summary.json").read_text())
    if minutes != minutes:  # reused: the run's own wall time, start-up included
        minutes = summary["wall_s"] / 60
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    spans = [json.loads(x) for x in (run_dir / "spans" / "orchestrator.jsonl").read_text().splitlines() if x.strip()]
    evals = sorted((e["t0"], e["t1"]) for e in spans if e.get("ev") == "eval")
    start = next(e["t"] for e in spans if e.get("ev") == "rl_start")
    curve = [(0.0, summary["base_accuracy"])]
    for t0_eval, t1_eval in evals:  # RL seconds at each evaluation, evaluations before it left out
        spent = sum(b - a for a, b in evals if b <= t0_eval)
        acc = next(e["accuracy"] for e in spans if e.get("ev") == "eval" and e["t0"] == t0_eval)
        curve.append((t0_eval - start - spent, acc))
    steps = [r for r in recs if "lag_hist" in r]
    generated = sum(int(e.get("tokens_generated", 0)) for e in summary["engines"])
    trained = sum(r.get("samples_trained", 0) for r in steps)
    rl_s = max(1e-9, summary["rl_wall_s"] - sum(b - a for a, b in evals))
    return {
        "arm": arm,
        "seed": seed,
        "curve": curve,
        "steps": summary["steps"],
        "minutes": minutes,
        "samples_per_s": trained / rl_s,
        "tokens_per_s": generated / rl_s,
        "peak_rss_gib": peak / 1024**3,
        "base": summary["base_accuracy"],
        "final": summary["final_accuracy"],
        "lr": _resolved_lr(folder / f"{name}.log"),
    }


def run_default_batch(folder: Path, new_tokens: int | None = None, steps: int = 1) -> dict:
    """`steps` steps with only model.path and the task set: the default batch (32 prompts x 8),
    completions of up to `new_tokens` (None: what the run resolves, 256), everything else resolved.
    Each process's peak proportional set size is compared with what the run's own memory plan
    (memory_plan.json) gave it."""
    from nonstop.models.fetch import fetch_model

    model, _ = fetch_model("smollm2", ROOT / ".nonstop_cache" / "models")
    overrides: dict[str, object] = {
        "model.path": model,
        "task.name": "jsonl",
        "task.dataset_path": ROOT / "examples/smollm2/train.jsonl",
        "task.eval_path": ROOT / "examples/smollm2/heldout.jsonl",
        "task.reward": "last_number",
        "run.max_steps": steps,
        "run.out_dir": folder,
        "run.name": "default-batch",
        "run.progress": "plain",
    }
    if new_tokens is not None:
        overrides["rollout.max_new_tokens"] = new_tokens
    cmd = [str(Path(sys.executable).parent / "nonstop"), "train", *sets(overrides)]
    peaks: dict[str, int] = {}  # each role's peak unique set size
    peak_total = 0  # the run's peak proportional set size, every process together
    with open(folder / "default-batch.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            now = memory_by_process(proc.pid)
            for name, (_, uss) in now.items():
                role = "engine" if "engine" in name else "trainer" if "trainer" in name else "orchestrator"
                peaks[role] = max(peaks.get(role, 0), uss)
            peak_total = max(peak_total, sum(pss for pss, _ in now.values()))
            time.sleep(1.0)
    plan = json.loads((folder / "default-batch" / "memory_plan.json").read_text())
    planned = {p["process"]: p["host_bytes_each"] for p in plan["processes"]}
    summary_path = folder / "default-batch" / "summary.json"
    steps_done = json.loads(summary_path.read_text())["steps"] if summary_path.exists() else 0
    over = {role: peaks[role] / planned[role] for role in peaks if role in planned}
    tokens = "resolved" if new_tokens is None else new_tokens
    print(f"\ndefault batch (32 x 8, max_new_tokens {tokens}), exit {proc.returncode}, {steps_done} steps:")
    for role, b in sorted(peaks.items()):
        plan_gib = planned.get(role, 0) / 1024**3
        print(f"  {role:>12}: peak {b / 1024**3:5.2f} GiB unique of a planned {plan_gib:5.2f} GiB")
    print(f"  {'all':>12}: peak {peak_total / 1024**3:5.2f} GiB of a planned {plan['total_bytes'] / 1024**3:5.2f} GiB")
    print("  (a process: its unique pages; all: every process's proportional set, shared pages once)")
    return {
        "default_batch_ok": int(proc.returncode == 0 and steps_done == steps),
        "default_batch_peak_gib": peak_total / 1024**3,
        "default_batch_plan_gib": plan["total_bytes"] / 1024**3,
        "default_batch_worst_over_plan": max(over.values()) if over else None,
    }


def _resolved_lr(log: Path) -> float | None:
    for line in log.read_text().splitlines():
        if line.startswith("trainer.lr: "):
            return float(line.split()[1])
    return None


def run_trl(seed: int, minutes: float, lr: float, folder: Path) -> dict:
    """TRL's arm in its own process (its threads and memory apart from the orchestrator's)."""
    out = folder / f"trl-s{seed}.json"
    cmd = [sys.executable, __file__, "--trl-child", str(out), "--seeds", str(seed), "--minutes", str(minutes)]
    cmd += ["--lr", repr(lr)]
    with open(folder / f"trl-s{seed}.log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads(out.read_text())


def trl_child(out: Path, seed: int, minutes: float, lr: float) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from nonstop.device import bf16_supported
    from nonstop.models.fetch import fetch_model
    from nonstop.scoring.rewards import last_number
    from trl_common import grpo_config

    folder, _ = fetch_model("smollm2", ROOT / ".nonstop_cache" / "models")
    rows = [json.loads(x) for x in (ROOT / "examples/smollm2/train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (ROOT / "examples/smollm2/heldout.jsonl").read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["messages"], "answer": r["answer"]} for r in rows])
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    bf16 = bf16_supported(torch.device("cpu"))

    def reward(prompts, completions, completion_ids, answer, **_):  # TRL's signature; messages in and out
        return [last_number(c[-1]["content"], a) for c, a in zip(completions, answer)]

    # held-out evaluation exactly as a nonstop run's: the built-in engine in the runs' dtype, greedy, on
    # the prompts nonstop renders and encodes, stopped at the same stop ids. A fresh engine over a copy
    # of TRL's current weights each time (the engine may derive state from its weights when built).
    from nonstop.config import EngineConfig
    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model, stop_token_ids
    from nonstop.tasks.chat import renderer
    from nonstop.types import GenerationRequest, SamplingParams

    render, stops = renderer(tok, None), stop_token_ids(tok, folder)
    held_ids = [tok(render(r["messages"]))["input_ids"] for r in held]
    judge_dtype = torch.bfloat16 if bf16 else torch.float32
    judge = load_model(str(folder), judge_dtype)
    settings = EngineConfig(
        dtype="bfloat16" if bf16 else "float32",
        max_seq_len=max(map(len, held_ids)) + MAX_NEW_TOKENS,
        max_concurrent_seqs=len(held_ids),
    )

    def evaluate() -> float:
        with torch.no_grad():
            judge.load_state_dict(model.state_dict())  # cast into the engine's dtype
        engine = TorchEngine(judge, stops, tok.pad_token_id, settings=settings)
        params = SamplingParams(MAX_NEW_TOKENS, 0.0)
        got = engine.generate([GenerationRequest(i, ids, 1, params) for i, ids in enumerate(held_ids)])
        answers = [str(tok.decode(g[0].completion_ids, skip_special_tokens=True)) for g in got]
        return sum((last_number(a, str(r["answer"])) for a, r in zip(answers, held)), 0.0) / len(held)

    args = grpo_config(
        str(out.parent / f"trl-s{seed}"),
        10**6,
        bf16,
        seed,
        per_device_train_batch_size=16,  # x 4 accumulated: 8 prompts x 8 completions a step, as the recipe;
        gradient_accumulation_steps=4,  # 64 at once took the machine's memory (its logits over 49,152 ids)
        num_generations=8,
        max_completion_length=MAX_NEW_TOKENS,
        learning_rate=lr,
        beta=0.0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
    eval_s = [0.0]
    t_start = [0.0]
    curve: list[tuple[float, float]] = []

    def clock() -> float:
        return time.perf_counter() - t_start[0] - eval_s[0]

    def timed_eval() -> None:
        at = clock() if curve else 0.0  # RL seconds so far, earlier evaluations left out
        t0 = time.perf_counter()
        model.eval()
        acc = evaluate()
        model.train()
        eval_s[0] += time.perf_counter() - t0
        curve.append((at, acc))

    class Curve(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            t_start[0] = time.perf_counter()
            timed_eval()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step % TRL_EVAL_EVERY == 0:
                timed_eval()
            if clock() >= minutes * 60:
                control.should_training_stop = True

    trainer.add_callback(Curve())
    trainer.train()
    steps = trainer.state.global_step
    rl_s = clock()
    out.write_text(
        json.dumps(
            {
                "arm": "trl",
                "seed": seed,
                "curve": curve,
                "steps": steps,
                "samples_per_s": steps * 64 / max(rl_s, 1e-9),
                "base": curve[0][1],
                "final": curve[-1][1],
                "rl_s": rl_s,
                "bf16": bf16,
            }
        )
    )


def time_to(curve: list[list[float]] | list[tuple[float, float]], target: float) -> float | None:
    """RL seconds at the first evaluation at or above `target`. Accuracies are k / 60 and the target a
    sum of two floats (0.65 + 0.05 = 0.7000000000000001), so the comparison allows float rounding:
    a reading of exactly 70% reaches a target of 70%."""
    return next((t for t, a in curve if a >= target - 1e-9), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="seed 0 only, 4 minutes an arm")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--arms", default="async,sync,trl")
    ap.add_argument(
        "--minutes",
        type=float,
        default=9.75,
        help="each arm's whole run, start-up included (run.max_total_s; the recipe's own 585 s: ten minutes less "
        "15 s for the shutdown)",
    )
    ap.add_argument("--set", dest="extra", action="append", default=[], help="more overrides for the nonstop arms")
    ap.add_argument("--default-tokens", type=int, default=None, help="the default arm's rollout.max_new_tokens")
    ap.add_argument("--default-steps", type=int, default=1, help="the default arm's steps")
    ap.add_argument(
        "--reuse", type=Path, default=None, help="read the async/sync arms from this earlier invocation's folder"
    )
    ap.add_argument("--trl-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    seeds = [0] if ns.quick else [int(s) for s in ns.seeds.split(",")]
    minutes = 4.0 if ns.quick else ns.minutes
    if ns.trl_child is not None:
        assert ns.lr is not None
        trl_child(ns.trl_child, seeds[0], minutes, ns.lr)
        return
    from nonstop.models.fetch import fetch_model

    fetch_model("smollm2", ROOT / ".nonstop_cache" / "models")
    arms = ns.arms.split(",")
    folder = Path(tempfile.mkdtemp(prefix="nonstop-real-"))
    print(f"runs in {folder}", flush=True)
    rows: list[dict] = []
    for seed in seeds:
        for arm in [a for a in arms if a in ("async", "sync")]:
            if ns.reuse is not None:
                rows.append(read_nonstop(arm, seed, ns.reuse, float("nan"), 0))
            else:
                rows.append(run_nonstop(arm, seed, minutes, folder, ns.extra))
            print_row(rows[-1])
    if "trl" in arms:
        lr = next((r["lr"] for r in rows if r["lr"] is not None), 8.6e-6)
        rows.append(run_trl(seeds[0], minutes, lr, folder))
        print_row(rows[-1])
    default = run_default_batch(folder, ns.default_tokens, ns.default_steps) if "default" in arms else {}
    if not rows:  # only the default arm: its memory figures are the whole result
        print("RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in default.items()))
        return
    target = min(0.99, max(a for r in rows for _, a in r["curve"][:2]) + TARGET_MARGIN)
    print(f"\ntarget: {target:.1%} held-out last_number (every arm's first two evaluations + {TARGET_MARGIN:.0%})")
    print(f"{'arm':>6} {'seed':>4} {'steps':>5} {'base':>6} {'final':>6} {'to target s':>11} {'samples/s':>9}")
    for r in rows:
        t = time_to(r["curve"], target)
        print(
            f"{r['arm']:>6} {r['seed']:>4} {r['steps']:>5} {r['base']:>6.1%} {r['final'] or 0:>6.1%} "
            f"{'-' if t is None else f'{t:.0f}':>11} {r['samples_per_s']:>9.1f}"
        )
    asyncs = [r for r in rows if r["arm"] == "async"]
    speedups = []
    for seed in seeds:
        a = next((time_to(r["curve"], target) for r in asyncs if r["seed"] == seed), None)
        s = next((r for r in rows if r["arm"] == "sync" and r["seed"] == seed), None)
        if a is not None and s is not None:
            t_sync = time_to(s["curve"], target)
            speedups.append((t_sync if t_sync is not None else minutes * 60) / a)  # a sync miss: its budget
    trl = next((r for r in rows if r["arm"] == "trl"), None)
    a0 = time_to(asyncs[0]["curve"], target) if asyncs else None
    ratio, reached = None, 0
    if trl is not None and a0 is not None:
        t_trl = time_to(trl["curve"], target)
        reached = int(t_trl is not None)
        ratio = (t_trl if t_trl is not None else trl["rl_s"]) / a0
    med = statistics.median
    figures = {
        "base": med(r["base"] for r in asyncs) if asyncs else None,
        "final": med(r["final"] or 0 for r in asyncs) if asyncs else None,
        "gain": med((r["final"] or 0) - r["base"] for r in asyncs) if asyncs else None,
        "min_gain": min((r["final"] or 0) - r["base"] for r in asyncs) if asyncs else None,
        "minutes": max(r["minutes"] for r in asyncs) if asyncs else None,
        "samples_per_s": med(r["samples_per_s"] for r in asyncs) if asyncs else None,
        "tokens_per_s": med(r["tokens_per_s"] for r in asyncs) if asyncs else None,
        "speedup_vs_sync": med(speedups) if speedups else None,
        "speedups": "/".join(f"{s:.2f}" for s in speedups) or None,
        "ratio_vs_trl": ratio,
        "trl_reached": reached,
        "trl_samples_per_s": trl["samples_per_s"] if trl else None,
        "target": target,
        "peak_rss_gib": max(r["peak_rss_gib"] for r in rows if "peak_rss_gib" in r) or None if asyncs else None,
        "seeds": len(seeds),
        **default,
    }
    print("RESULT " + " ".join(f"{k}={_fmt(v)}" for k, v in figures.items()))


def _fmt(v: object) -> str:
    if v is None:
        return "nan"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def print_row(r: dict) -> None:
    curve = " ".join(f"{t:.0f}s:{a:.0%}" for t, a in r["curve"])
    print(
        f"{r['arm']} seed {r['seed']}: {r['steps']} steps, {r['samples_per_s']:.1f} samples/s; curve {curve}",
        flush=True,
    )


if __name__ == "__main__":
    main()
