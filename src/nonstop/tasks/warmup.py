"""The supervised warm-up: from a fresh tiny model to a weak (not blank) base policy.

RL sharpens what a policy half knows; a blank model gets no reward to learn from. The warm-up
trains the tiny model on the train split (prompt -> answer + EOS, loss on the answer only)
and stops as soon as greedy held-out accuracy on a gate of up to 200 held-out prompts reaches
`target_accuracy` (checked every `eval_every` steps; a fixed step count gives bases of very
different strength, because the accuracy jumps at a seed-dependent step).

The warm-up is chaotic: float results differ between CPU instruction sets (AVX2, AVX-512), so
the same seed ends in different places on different machines. The default job therefore starts
from a base shipped with the package (tasks/base.py); the warm-up serves users' own tasks and
shapes, and rebuilds the shipped base (`nonstop warmup --out DIR`). `cached_warmup` saves its
result under `cache_dir/base-<hash>`, the hash covering everything that shapes it, written
atomically (temp folder, then rename), so a later run loads it in a second.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nonstop.config import Config
from nonstop.engine.core import TorchEngine
from nonstop.hf import quiet_transformers
from nonstop.tasks.codec import Codec, exact_match_accuracy, greedy_requests
from nonstop.tasks.data import Example, TaskData
from nonstop.tasks.tiny import make_char_tokenizer, make_tiny_model

GATE_SIZE = 200  # held-out prompts of the accuracy gate


def greedy_accuracy(engine: TorchEngine, tokenizer, examples: list[Example], max_new_tokens: int) -> float:
    """Held-out accuracy on an in-process engine, scored exactly like the pipeline's evaluation."""
    codec = Codec(tokenizer)
    return exact_match_accuracy(engine.generate(greedy_requests(examples, codec, max_new_tokens)), examples, codec)


def warmup_seed(cfg: Config) -> int:
    return cfg.run.seed if cfg.warmup.seed is None else cfg.warmup.seed


def _cache_key(cfg: Config) -> str:
    shaping = {
        "tiny": cfg.model.tiny.model_dump(exclude_none=True),  # a dense model keeps its pre-MoE key
        "task": cfg.task.model_dump(exclude={"reward"}),
        "warmup": {
            **cfg.warmup.model_dump(exclude={"cache_dir", "seed", "max_time_s", "threads"}),
            "enabled": cfg.warmup_enabled,
        },
        "seed": warmup_seed(cfg),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "format": 3,
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def sft_batch(encoded: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, labels) of prompt + answer rows, right-padded, loss on the answer only."""
    L = max(len(p) + len(a) for p, a in encoded)
    ids = torch.full((len(encoded), L), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), L), -100, dtype=torch.long)
    attn = torch.zeros((len(encoded), L), dtype=torch.long)
    for r, (p, a) in enumerate(encoded):
        ids[r, : len(p) + len(a)] = torch.tensor(p + a)
        labels[r, len(p) : len(p) + len(a)] = torch.tensor(a)
        attn[r, : len(p) + len(a)] = 1
    return ids, attn, labels


def _sft(model, tokenizer, data: TaskData, cfg: Config, log: Callable[[str], None]) -> dict:
    """Supervised steps until the gate. The gate is checked every `eval_every` steps; when a check
    crosses it (and `replay_crossing`), the warm-up goes back to the state of the check before
    (weights, optimiser, batch order) and replays those steps one at a time, checking after each,
    so it stops at the first step at or above the target."""
    w = cfg.warmup
    rng = random.Random(warmup_seed(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
    engine = TorchEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    gate = data.eval[: min(len(data.eval), GATE_SIZE)]
    encoded = [
        (tokenizer(ex.prompt)["input_ids"], tokenizer(ex.answer)["input_ids"] + [tokenizer.eos_token_id])
        for ex in data.train
    ]
    acc, step, t0, curve = 0.0, 0, time.perf_counter(), []
    limit_s, stopped, every = cfg.warmup_time_limit_s, "max_steps", w.eval_every
    before = _snapshot(model, opt, rng, step) if w.replay_crossing else None
    while step < w.max_steps:
        model.train()
        ids, attn, labels = sft_batch(rng.sample(encoded, min(w.batch_size, len(encoded))), tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        out_of_time = limit_s is not None and time.perf_counter() - t0 >= limit_s
        if step % every == 0 or out_of_time:
            model.eval()
            acc = greedy_accuracy(engine, tokenizer, gate, cfg.rollout.max_new_tokens)
            curve.append([step, acc])
            log(f"warm-up step {step}: loss {loss.item():.3f}, held-out accuracy {acc:.1%}")
            if acc >= w.target_accuracy and every > 1 and before is not None and not out_of_time:
                step = _restore(model, opt, rng, before)
                every = 1  # replay the crossing's steps one at a time
                continue
            if acc >= w.target_accuracy:
                stopped = "gate"
                break
            if out_of_time:
                stopped = "max_time_s"
                log(f"warm-up stopped by its time limit ({limit_s:.0f} s) below the gate")
                break
            if every > 1 and w.replay_crossing:
                before = _snapshot(model, opt, rng, step)
    return {
        "stopped": stopped,
        "steps": step,
        "gate_accuracy": acc,
        "gate_size": len(gate),
        "gate_curve": curve,
        "seconds": time.perf_counter() - t0,
    }


def _snapshot(model, opt, rng: random.Random, step: int) -> tuple:
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), rng.getstate(), step


def _restore(model, opt, rng: random.Random, snapshot: tuple) -> int:
    weights, opt_state, rng_state, step = snapshot
    model.load_state_dict(weights)
    opt.load_state_dict(opt_state)
    rng.setstate(rng_state)
    return step


def warm_up(cfg: Config, data: TaskData, log: Callable[[str], None] = print, threads: int | None = None):
    """A fresh tiny model (seeded by warmup.seed, else run.seed) trained to the accuracy gate on
    `threads` torch threads (None: warmup.threads). Returns (model, tokenizer, info) with info =
    {stopped, steps, gate_accuracy, gate_size, gate_curve, seconds}."""
    threads = cfg.warmup.threads if threads is None else threads
    quiet_transformers()
    tokenizer = make_char_tokenizer()
    model = make_tiny_model(cfg.model.tiny, warmup_seed(cfg))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        info = _sft(model, tokenizer, data, cfg, log)
    finally:
        torch.set_num_threads(previous)
    log(f"warm-up done in {info['seconds']:.1f} s ({info['steps']} steps, gate accuracy {info['gate_accuracy']:.1%})")
    return model.eval(), tokenizer, info


def save_atomically(folder: Path, model, tokenizer, files: dict[str, dict]) -> Path:
    """Write model, tokenizer and the given JSON files to a temp folder beside `folder`, then rename."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{time.time_ns()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, content in files.items():
        (tmp / name).write_text(json.dumps(content, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def cached_base(cfg: Config, data: TaskData, warmup: bool, log: Callable[[str], None] = print) -> Path:
    """The tiny model after the warm-up (`warmup`) or freshly initialised, cached in warmup.cache_dir."""
    folder = Path(cfg.warmup.cache_dir) / (f"base-{_cache_key(cfg)}" if warmup else f"init-{_cache_key(cfg)}")
    if (folder / "nonstop_base.json").is_file():
        log(f"base policy: cached at {folder}")
        return folder
    if warmup:
        model, tokenizer, info = warm_up(cfg, data, log)
        info["warmup"] = True
    else:
        quiet_transformers()
        model, tokenizer, info = (
            make_tiny_model(cfg.model.tiny, warmup_seed(cfg)),
            make_char_tokenizer(),
            {"warmup": False},
        )
    return save_atomically(folder, model, tokenizer, {"nonstop_base.json": info})
