"""A real model shape on this machine: Qwen2.5-0.5B's shape in four arms (issue 31, docs/memory.md).

The model is made here with Qwen2.5-0.5B's exact shape (hidden 896, 24 layers, 14 heads, 2 KV
heads, MLP 4,864, vocabulary 151,936, tied embeddings: 494 M parameters), random weights, saved
with `save_pretrained` next to nonstop's character tokenizer, as a user's model folder would be.
Every arm is the real CLI with only `model.path` and the task set (the built-in addition task,
`--steps` steps of 2 prompts x 8 completions, buffer depth 0 so the mismatch KL is the engine's
and trainer's numerics alone), every other setting at its default:

- full / builtin: full fine-tune, the built-in engine (precision `auto`: bf16 where this CPU has it);
- full-fp32 / builtin: the same with `trainer.precision=float32 engine.dtype=float32`;
- batch and batch-fp32 / builtin: full and full-fp32 at a batch of real size, 8 prompts x 8
  answers of 16 tokens (1,024 completion tokens a step, the in-process trainer's count): the
  reference of `cli_bf16_step_speedup`;
- lora / builtin: `model.lora.enabled=true`;
- full / vllm and lora / vllm: `engine.kind=vllm`, run with .venv-vllm's interpreter (`make
  venv-vllm`); without it these rows say so and the others still run.

Per arm: peak RSS per process (VmHWM of each actor, polled every 0.5 s) and its largest sampled
anonymous RSS beside the memory plan's figure for it, the median trainer step
(steps after the first), the trainer's achieved FLOP/s as a fraction of its measured matmul peak,
publish time as a fraction of step time, the engine's tokens/s while busy against HF `generate`
on the same prompts in this process, and the depth-0 mismatch KL (k3).

The other CLI arms' batches are tiny (2 prompts x 8 answers of a few tokens): their trainer step
is the optimizer and the per-step fixed costs, not matmuls (`cli_bf16_step_speedup_tiny`, full-fp32
over full). The bench also measures, in fresh
processes on one thread each, the trainer actor's own code (TrainerWorker) on a batch of real
size (`--batch`, default 8 completions x 128 tokens) in float32 and in bfloat16 autocast (the
median of 3 steps after 2 warm-up steps), and the built-in engine decoding 16 rows, then 64 rows
(the engine's batch in a run), of 64 new tokens with float32 and with bfloat16 weights.

    python bench/scale.py [--steps 5] [--batch 8x128] \
        [--arms full,full-fp32,batch,batch-fp32,full-overlap,lora,full-vllm,lora-vllm]

Last line: `RESULT trainer_peak_frac=... bf16_step_speedup=... engine_bf16_speedup=... engine_bf16_speedup_64=...
lora_mem_ratio=... publish_frac=... publish_s=... peak_rss_gib=... arms_ok=... cli_trainer_peak_frac=...
cli_bf16_step_speedup=... anon_over_plan=...`: the bf16 trainer's fraction of its matmul peak and the fp32 step over
the bf16 step at the real batch, bf16 decode over fp32 decode, LoRA's peak trainer RSS over full
fine-tuning's, the full builtin arm's publish time over its step and in seconds (the step's time moves with the
machine's load, the publish's much less), the largest process's peak,
the full arm's own trainer fraction, the CLI's bf16 step speedup at the real batch (batch-fp32's step over
batch's; `cli_bf16_step_speedup_tiny`: the same over the tiny full arms) and the batch arm's trainer fraction
(`cli_batch_peak_frac`), the largest ratio of a process's sampled
anonymous RSS to what the run's memory plan (memory_plan.json) gave it (above 1: the plan was under),
the in-process bf16 step over the same step under autocast alone (cast_once_speedup: the weights
cast once per optimizer step into bf16 copies, trainer/compute.py, against a cast per autocast region),
and the full-overlap arm's publish cost over its step and in seconds (publish_frac_overlap,
publish_s_overlap: trainer.publish_overlap at buffer depth 1, where the next batch's forward runs
beside the send). A publish's cost is what it keeps the learning loop waiting: inline, the whole
send; overlapped, its launch plus the next optimizer step's wait for the send (publish_wait_s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.cli import sets  # noqa: E402

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
WARM_STEPS = 2  # in-process trainer steps left out of its median
FP32: dict[str, object] = {"trainer.precision": "float32", "engine.dtype": "float32"}
CLI_BATCH: dict[str, object] = {
    "rollout.prompts_per_step": 8,
    "rollout.max_new_tokens": 16,
    "trainer.micro_batch_tokens": 358,
}
"""The batch arms' step: 8 prompts x 8 answers of 16 tokens (the random-weights model never ends its
turn), 1,024 completion tokens, as many as the in-process trainer's 8 x 128; 1,072 forward tokens
with the prompts. Both precisions train it in the same 3 micro-batches: 358 tokens is the budget the
memory plan resolves for float32 on a 23 GiB machine (bf16, whose plan is smaller, resolves the
whole batch at once), so the ratio of the two steps is the precision's alone."""
ARMS: dict[str, dict[str, object]] = {
    "full": {},
    "full-fp32": FP32,
    # a batch of real size through the CLI: the reference of cli_bf16_step_speedup
    "batch": CLI_BATCH,
    "batch-fp32": {**CLI_BATCH, **FP32},
    # the send on the trainer's thread beside the next batch's forward: at depth 1, where there is a
    # next forward to hide it behind (at depth 0 the engine waits for the send whatever the trainer does)
    "full-overlap": {"trainer.publish_overlap": True, "buffer.depth": 1, "buffer.max_lag": 1},
    "lora": {"model.lora.enabled": True},
    "full-vllm": {"engine.kind": "vllm"},
    "lora-vllm": {"engine.kind": "vllm", "model.lora.enabled": True},
}


def make_model(path: Path) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from nonstop.models.tiny import make_char_tokenizer

    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        max_position_embeddings=32_768,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    make_char_tokenizer().save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


class RssPoller:
    """Peak RSS (VmHWM, bytes) of every process under `root_pid`, by its title (`nonstop: engine`),
    and the largest anonymous RSS (RssAnon) seen in its samples: what the memory plan budgets per
    process, without the shared-memory slots (planned once, as the segment) and the mapped
    safetensors file (page cache). Sampled every 0.5 s, so a shorter spike can be missed."""

    def __init__(self, root_pid: int) -> None:
        self.root, self.stop = root_pid, threading.Event()
        self.peaks: dict[str, int] = {}
        self.anon: dict[str, int] = {}
        self.thread = threading.Thread(target=self.run, name="rss-poller", daemon=True)
        self.thread.start()

    def descendants(self) -> list[int]:
        kids: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                kids.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += kids.get(pid, [])
        return out

    def run(self) -> None:
        while not self.stop.wait(0.5):
            for pid in self.descendants():
                try:
                    title = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]).decode(errors="replace")
                    status = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                kib = {
                    x.split(":")[0]: int(x.split()[1])
                    for x in status.splitlines()
                    if x.startswith(("VmHWM:", "RssAnon:"))
                }
                role = title.split(":", 1)[1].strip() if title.startswith("nonstop:") else "orchestrator"
                if pid == self.root or title.startswith("nonstop:"):
                    self.peaks[role] = max(self.peaks.get(role, 0), kib.get("VmHWM", 0) * 1024)
                    self.anon[role] = max(self.anon.get(role, 0), kib.get("RssAnon", 0) * 1024)

    def close(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join()
        return self.peaks


def plan_of(path: Path) -> dict[str, int]:
    """Host bytes the run's memory plan gave each process kind ("engine", "trainer", ...)."""
    if not path.exists():
        return {}
    procs = json.loads(path.read_text())["processes"]
    return {p["process"]: int(p["host_bytes_each"]) for p in procs}


def run_arm(name: str, model_dir: Path, steps: int, folder: Path) -> dict | None:
    py = str(VLLM_PY) if name.endswith("vllm") else sys.executable
    if name.endswith("vllm") and not VLLM_PY.exists():
        return None
    overrides = {
        "model.path": model_dir,
        "run.max_steps": steps,
        "run.max_time_s": None,
        "run.eval_every": 10**6,
        "task.eval_size": 8,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 8,
        # the addition task's answers; a loaded model's default of 256 would have this random-weights
        # model, which never ends its turn, write 256 tokens an answer
        "rollout.max_new_tokens": 4,
        "rollout.filter_uniform_reward": False,
        "buffer.depth": 0,
        "buffer.max_lag": 0,
        "checkpoint.every_steps": None,
        "run.out_dir": folder,
        "run.name": name,
        "run.progress": "plain",
    }
    args = [py, "-m", "nonstop.cli", "train", *sets(overrides), *sets(ARMS[name])]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.Popen(args, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    poller = RssPoller(proc.pid)
    out, _ = proc.communicate()
    peaks = poller.close()
    plan = plan_of(folder / name / "memory_plan.json")
    anon = {role: (poller.anon[role], plan[role]) for role in poller.anon if role in plan}
    if proc.returncode != 0:
        print(f"{name}: failed (exit {proc.returncode})\n{out[-3000:]}", flush=True)
        return {"arm": name, "failed": True, "peaks": peaks, "anon": anon}
    run_dir = folder / name
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_recs = [r for r in recs if "train_s" in r]  # step records (the trainer's metrics are flattened in)
    tr = step_recs[1:] or step_recs
    eng = summary["engines"]
    busy = sum(float(e.get("busy_s", 0.0)) for e in eng)
    return {
        "arm": name,
        "failed": False,
        "peaks": peaks,
        "anon": anon,
        "step_s": statistics.median(t["train_s"] for t in tr),
        "precision": tr[-1].get("precision"),
        "peak_frac": statistics.median(t.get("peak_frac", 0.0) for t in tr),
        # what the publish keeps the learning loop waiting: inline, the whole send; overlapped, its launch
        # plus the next optimizer step's wait for the send (publish_wait_s)
        "publish_frac": statistics.median((t["publish_s"] + t.get("publish_wait_s", 0.0)) / t["train_s"] for t in tr),
        "publish_s": statistics.median(t["publish_s"] + t.get("publish_wait_s", 0.0) for t in tr),
        "engine_tok_s": sum(int(e.get("tokens_generated", 0)) for e in eng) / busy if busy > 0 else None,
        "mismatch_kl": statistics.median(t.get("mismatch_kl_k3", 0.0) for t in tr),
    }


def hf_generate_tok_s(model_dir: Path) -> float:
    """HF generate on 2 prompts x 8 samples of 16 new tokens (EOS off), this process, one thread."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok(["12+34=", "56+7="] * 8, return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**ids, max_new_tokens=2, do_sample=True, pad_token_id=0)  # warm-up
        t0 = time.perf_counter()
        model.generate(**ids, max_new_tokens=16, min_new_tokens=16, do_sample=True, pad_token_id=0)
    return 16 * 16 / (time.perf_counter() - t0)


def inner_trainer(model_dir: Path, precision: str, samples: int, tokens: int, steps: int) -> dict:
    """The trainer actor's own code (TrainerWorker, one thread) on a batch of `samples` completions of
    `tokens` random tokens (2 prompts of 16): median step seconds and peak fraction of the steps after
    the first WARM_STEPS (their time is the first touch of the optimizer state, the gradients and the
    kept heap: 30-60 s at this shape against a steady 9-25 s)."""
    import torch

    from nonstop.config import TrainerConfig
    from nonstop.trainer.worker import TrainerWorker
    from nonstop.types import Group, Sample

    torch.set_num_threads(1)
    autocast_only = precision == "bfloat16-autocast"  # the bf16 step before trainer/compute.py: autocast alone
    cfg = TrainerConfig.model_validate({"lr": 1e-6, "precision": "bfloat16" if autocast_only else precision})
    worker = TrainerWorker(str(model_dir), cfg, 1.0, 0)
    if autocast_only:
        worker.compute = worker.trainer.compute = None
    gen = torch.Generator().manual_seed(1)

    def batch() -> list[Group]:
        groups = []
        for i in range(2):
            prompt = torch.randint(1, 151_000, (16,), generator=gen).tolist()
            group = []
            for j in range(samples // 2):
                ids = torch.randint(1, 151_000, (tokens,), generator=gen).tolist()
                group.append(Sample(prompt, ids, [-11.9] * tokens, [0] * tokens, "length", reward=float(j % 2)))
            groups.append(Group(i, "p", "a", group))
        return groups

    records = [worker.step(batch()).metrics for _ in range(steps)][WARM_STEPS:]
    return {
        "step_s": statistics.median(float(m["train_s"]) for m in records),
        "peak_frac": statistics.median(float(m["peak_frac"]) for m in records),
        "update_s": statistics.median(float(m["update_s"]) for m in records),
        "precision": records[-1]["precision"],
    }


def inner_engine(model_dir: Path, dtype: str, rows: int, new_tokens: int) -> dict:
    """The built-in engine (one thread) decoding `rows` sequences of `new_tokens` (EOS off) from 2
    prompts, after a warm-up request: tokens/s of the whole generate, prefill and sampling included."""
    import torch

    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model
    from nonstop.types import GenerationRequest, SamplingParams

    torch.set_num_threads(1)
    model = load_model(str(model_dir), getattr(torch, dtype)).eval()
    engine = TorchEngine(model, [], 0)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]

    def run(n: int) -> float:
        reqs = [GenerationRequest(i, p, rows // 2, SamplingParams(n, 1.0, seed=i)) for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        engine.generate(reqs)
        return time.perf_counter() - t0

    run(4)
    return {"tok_s": rows * new_tokens / run(new_tokens)}


def inner(kind: str, model_dir: Path, arg: str) -> dict:
    """One in-process measurement in a fresh interpreter (its own peak memory, nothing left over)."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import scale; "
        f"print('INNER ' + json.dumps(scale.{kind}(scale.Path({str(model_dir)!r}), {arg})))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("INNER ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"{kind}({arg}) failed:\n{out.stderr[-3000:]}")
    return json.loads(line[len("INNER ") :])


def realistic(model_dir: Path, samples: int, tokens: int, steps: int) -> tuple[float, float, float, float, float]:
    """The trainer at a batch of real size and the engine's decode, fp32 against bf16, side by side:
    (bf16 trainer peak fraction, bf16 step speedup, bf16 decode speedup at 16 rows, at 64 rows, the bf16
    step with its weights cast once per optimizer step (trainer/compute.py) over autocast alone)."""
    kinds = ("float32", "bfloat16", "bfloat16-autocast")
    t = {p: inner("inner_trainer", model_dir, f"{p!r}, {samples}, {tokens}, {steps}") for p in kinds}
    e = {(d, n): inner("inner_engine", model_dir, f"{d!r}, {n}, 64") for n in (16, 64) for d in ("float32", "bfloat16")}
    print(f"\nIn-process, one thread, a batch of {samples} x {tokens} completion tokens (2 prompts of 16):\n")
    print("| precision | trainer step | optimizer (update_s) | trainer % of matmul peak | decode, 16 rows | 64 rows |")
    print("|---|---|---|---|---|---|")
    for p in ("float32", "bfloat16"):
        r = t[p]
        print(
            f"| {p} | {r['step_s']:.1f} s | {r['update_s']:.1f} s | {r['peak_frac']:.0%} "
            f"| {e[p, 16]['tok_s']:.1f} tokens/s | {e[p, 64]['tok_s']:.1f} tokens/s |"
        )
    r = t["bfloat16-autocast"]
    print(f"| bfloat16, autocast alone | {r['step_s']:.1f} s | {r['update_s']:.1f} s | {r['peak_frac']:.0%} | - | - |")
    step_speedup = t["float32"]["step_s"] / t["bfloat16"]["step_s"]
    cast_once = r["step_s"] / t["bfloat16"]["step_s"]
    decode = {n: e["bfloat16", n]["tok_s"] / e["float32", n]["tok_s"] for n in (16, 64)}
    print(
        f"\nbf16 over fp32: trainer step {step_speedup:.2f}x, engine decode {decode[16]:.2f}x (16 rows), "
        f"{decode[64]:.2f}x (64 rows); weights cast once per step over autocast alone: {cast_once:.2f}x",
        flush=True,
    )
    return t["bfloat16"]["peak_frac"], step_speedup, decode[16], decode[64], cast_once


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--batch", default="8x128", help="in-process trainer batch: completions x tokens ('' skips it)")
    ns = p.parse_args()
    real = (float("nan"),) * 5
    with tempfile.TemporaryDirectory(prefix="nonstop-scale-") as tmp:
        model_dir = Path(tmp) / "qwen2.5-0.5b-shape"
        n = make_model(model_dir)
        print(f"model: Qwen2.5-0.5B shape, {n / 1e6:.0f} M parameters, random weights, {model_dir}", flush=True)
        hf = hf_generate_tok_s(model_dir)
        print(f"HF generate (fp32, 1 thread, 16 sequences): {hf:.1f} tokens/s", flush=True)
        rows = []
        for name in [a for a in ns.arms.split(",") if a]:
            r = run_arm(name, model_dir, ns.steps, Path(tmp))
            if r is None:
                print(f"{name:>10}: not run (no .venv-vllm: make venv-vllm)", flush=True)
                continue
            rows.append(r)
            print_row(r, hf)
        if ns.batch:
            samples, tokens = (int(x) for x in ns.batch.split("x"))
            real = realistic(model_dir, samples, tokens, WARM_STEPS + 3)
    by = {r["arm"]: r for r in rows if not r["failed"]}
    full, f32, lora = by.get("full"), by.get("full-fp32"), by.get("lora")
    overlap = by.get("full-overlap")
    tiny = f32["step_s"] / full["step_s"] if full and f32 else float("nan")
    b16, b32 = by.get("batch"), by.get("batch-fp32")
    speedup = b32["step_s"] / b16["step_s"] if b16 and b32 else float("nan")
    mem = lora["peaks"].get("trainer", 0) / full["peaks"]["trainer"] if full and lora else float("nan")
    peak_rss = max((v for r in rows for v in r["peaks"].values()), default=0) / 2**30
    # the largest process's measured anonymous peak over its plan: above 1 the plan was under
    plan_frac = max((a / b for r in rows for a, b in r["anon"].values() if b), default=float("nan"))
    print(
        f"RESULT trainer_peak_frac={real[0]:.3f} bf16_step_speedup={real[1]:.2f} engine_bf16_speedup={real[2]:.2f} "
        f"engine_bf16_speedup_64={real[3]:.2f} "
        f"lora_mem_ratio={mem:.2f} publish_frac={full['publish_frac'] if full else float('nan'):.3f} "
        f"publish_s={full['publish_s'] if full else float('nan'):.3f} "
        f"peak_rss_gib={peak_rss:.1f} arms_ok={len(by)}/{len(rows)} cli_trainer_peak_frac="
        f"{full['peak_frac'] if full else float('nan'):.3f} cli_bf16_step_speedup={speedup:.2f} "
        f"cli_bf16_step_speedup_tiny={tiny:.2f} "
        f"cli_batch_peak_frac={b16['peak_frac'] if b16 else float('nan'):.3f} "
        f"anon_over_plan={plan_frac:.2f} cast_once_speedup={real[4]:.2f} "
        f"publish_frac_overlap={overlap['publish_frac'] if overlap else float('nan'):.3f} "
        f"publish_s_overlap={overlap['publish_s'] if overlap else float('nan'):.3f}"
    )


def print_row(r: dict, hf: float) -> None:
    rss = " ".join(f"{k} {v / 2**30:.1f}G" for k, v in sorted(r["peaks"].items()))
    rss += "; anonymous / plan: " + " ".join(
        f"{k} {a / 2**30:.1f}/{b / 2**30:.1f}G" for k, (a, b) in sorted(r["anon"].items())
    )
    if r["failed"]:
        print(f"{r['arm']:>10}: FAILED; peak RSS {rss}", flush=True)
        return
    eng = f"{r['engine_tok_s']:.1f} tok/s ({r['engine_tok_s'] / hf:.2f}x HF)" if r["engine_tok_s"] else "n/a"
    print(
        f"{r['arm']:>10}: {r['precision']} step {r['step_s']:.2f}s, trainer {r['peak_frac']:.0%} of peak, "
        f"publish {r['publish_s']:.2f}s = {r['publish_frac']:.1%} of step, engine {eng}, "
        f"mismatch KL {r['mismatch_kl']:.2e}; peak RSS {rss}",
        flush=True,
    )


if __name__ == "__main__":
    main()
