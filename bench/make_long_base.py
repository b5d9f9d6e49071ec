"""Build the shipped base of the long-rollout task, nonstop/assets/long-base.

Three steps, all on this machine and without downloads:
1. the task's rows (nonstop.tasks.long_rollout, pure Python, the same everywhere) split into train
   and held-out exactly as a run splits them (task.split_seed, task.eval_size);
2. a byte-level BPE tokenizer trained on the train split's text (nonstop.models.bpe);
3. a fresh Qwen2 model of a few million parameters, trained by a supervised warm-up on the worked
   solutions (loss on the solution tokens, batches of similar lengths under a token budget) until
   greedy accuracy on a gate of held-out prompts reaches --target: a weak, not blank, base.

The weights are rounded to float16 and saved with the tokenizer; the held-out accuracy in
provenance.json is measured on the rounded weights, as a run loads them. A warm-up is chaotic in
floating point (float results differ between AVX2 and AVX-512 machines), so the base is built once
and shipped, never rebuilt at install time: `nonstop.models.shipped.verify` checks its sha256.

    python bench/make_long_base.py [--threads 1] [--out src/nonstop/assets/long-base]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, Qwen2Config

from nonstop.config import EngineConfig, TaskConfig
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer, quiet_transformers
from nonstop.models.bpe import merged_tokens, train_bpe
from nonstop.models.shipped import PROVENANCE, sha256_file
from nonstop.models.warmup import greedy_accuracy, sft_batch
from nonstop.tasks import long_rollout as task
from nonstop.tasks.data import load_task

ROOT = Path(__file__).resolve().parent.parent
MAX_NEW_TOKENS = 1024
MAX_POSITIONS = 1088  # the longest prompt (25 tokens) + MAX_NEW_TOKENS, rounded up


def quantiles(values: list[int]) -> dict[str, float]:
    s = sorted(values)
    q = lambda p: s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"median": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": s[-1], "mean": round(sum(s) / len(s), 1)}


def encode(tok, examples) -> list[tuple[list[int], list[int]]]:
    return [(tok(ex.prompt)["input_ids"], tok(ex.answer)["input_ids"] + [tok.eos_token_id]) for ex in examples]


def length_batches(encoded, rng: random.Random, token_budget: int, pool: int = 1024) -> list[list[int]]:
    """Batches of similar lengths (a random pool sorted by length, cut where the padded size would
    pass `token_budget`), in random order: every step costs about the same, little goes to padding."""
    idx = rng.sample(range(len(encoded)), min(pool, len(encoded)))
    idx.sort(key=lambda i: len(encoded[i][0]) + len(encoded[i][1]))
    out: list[list[int]] = [[]]
    for i in idx:
        n = len(encoded[i][0]) + len(encoded[i][1])
        if out[-1] and n * (len(out[-1]) + 1) > token_budget:
            out.append([])
        out[-1].append(i)
    rng.shuffle(out)
    return out


def sft_step(model, opt, batch, pad_id: int) -> tuple[float, int]:
    ids, attn, labels = sft_batch(batch, pad_id)
    loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.item(), int(attn.sum())


def accuracy(model, tok, examples) -> float:
    settings = EngineConfig(max_concurrent_seqs=len(examples), max_seq_len=MAX_POSITIONS)
    engine = TorchEngine(model.eval(), [tok.eos_token_id], tok.pad_token_id, settings=settings)
    with torch.no_grad():
        return greedy_accuracy(engine, tok, examples, MAX_NEW_TOKENS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "src" / "nonstop" / "assets" / "long-base")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and batch order")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--vocab-size", type=int, default=512, help="BPE vocabulary cap (merges stop earlier if none remain)"
    )
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=576)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--token-budget", type=int, default=2048, help="padded tokens per warm-up batch")
    ap.add_argument("--target", type=float, default=0.3, help="stop once gate accuracy reaches this")
    ap.add_argument("--gate-size", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--max-seconds", type=float, default=1500, help="give up on the gate after this long")
    ns = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(ns.threads)
    t_start = time.perf_counter()

    cfg = TaskConfig(name=task.NAME)
    data = load_task(cfg)
    tok = train_bpe(task.corpus([(ex.prompt, ex.answer) for ex in data.train]), ns.vocab_size)
    lengths = [len(tok(ex.answer)["input_ids"]) for ex in data.train + data.eval]
    print(f"tokenizer: {len(tok)} tokens ({len(merged_tokens(tok))} merges); completion tokens {quantiles(lengths)}")

    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=ns.hidden,
        intermediate_size=ns.intermediate,
        num_hidden_layers=ns.layers,
        num_attention_heads=ns.heads,
        num_key_value_heads=ns.kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(ns.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f} M parameters")

    rng = random.Random(ns.seed)
    encoded = encode(tok, data.train)
    gate = data.eval[: ns.gate_size]
    opt = torch.optim.AdamW(model.parameters(), lr=ns.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    step, tokens, gate_acc, curve, t0 = 0, 0, 0.0, [], time.perf_counter()
    queue: list[list[int]] = []
    while step < ns.max_steps and time.perf_counter() - t0 < ns.max_seconds:
        if not queue:
            queue = length_batches(encoded, rng, ns.token_budget)
        model.train()
        loss, n = sft_step(model, opt, [encoded[i] for i in queue.pop()], tok.pad_token_id)
        sched.step()
        step, tokens = step + 1, tokens + n
        if step % ns.eval_every == 0:
            gate_acc = accuracy(model, tok, gate)
            curve.append([step, gate_acc])
            print(
                f"step {step}: loss {loss:.3f}, gate accuracy {gate_acc:.1%}, "
                f"{tokens} tokens, {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
            if gate_acc >= ns.target:
                break
    warmup_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="nonstop-long-base-") as tmp:
        model.to(torch.float16).save_pretrained(tmp)  # half precision: half the bytes to ship
        tok.save_pretrained(tmp)
        shipped = load_model(tmp)  # float32, as a run loads it: the accuracy of what ships
        heldout = accuracy(shipped, load_tokenizer(tmp), data.eval)
        ns.out.mkdir(parents=True, exist_ok=True)
        for f in Path(tmp).iterdir():
            shutil.copyfile(f, ns.out / f.name)
    argv = " ".join(sys.argv[1:])
    prov = {
        "command": f"python bench/make_long_base.py {argv}".strip(),
        "seed": ns.seed,
        "task": {**cfg.model_dump(include={"name", "split_seed", "eval_size"}), "rows": task.ROWS},
        "rows_seed": task.ROWS_SEED,
        "steps_range": [task.K_MIN, task.K_MAX],
        "completion_tokens": quantiles(lengths),
        "max_new_tokens": MAX_NEW_TOKENS,
        "tokenizer": {"vocab": len(tok), "merges": len(merged_tokens(tok)), "vocab_cap": ns.vocab_size},
        "model": {k: getattr(ns, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")}
        | {"parameters": params, "max_positions": MAX_POSITIONS, "dtype": "float16"},
        "warmup": {k: getattr(ns, k) for k in ("lr", "token_budget", "target", "gate_size", "eval_every")}
        | {"steps": step, "tokens": tokens, "seconds": round(warmup_s, 1)},
        "gate_curve": curve,
        "gate_accuracy": gate_acc,
        "heldout_accuracy": heldout,
        "heldout_size": len(data.eval),
        "sha256": sha256_file(ns.out / "model.safetensors"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "threads": ns.threads,
        "seconds": round(time.perf_counter() - t_start, 1),
    }
    (ns.out / PROVENANCE).write_text(json.dumps(prov, indent=1) + "\n")
    print(f"long-rollout base written to {ns.out}: held-out accuracy {heldout:.1%}, sha256 {prov['sha256'][:12]}")


if __name__ == "__main__":
    main()
