"""Base policy: the tiny model, optionally after a short supervised warm-up, cached on disk.

RL sharpens what a policy half knows; a blank model gets no reward to learn from. The warm-up
trains the tiny model on the train split (prompt -> answer + EOS, loss on the answer only)
and stops as soon as greedy held-out accuracy reaches `target_accuracy` (checked every
`eval_every` steps; a fixed step count gives bases of very different strength, because the
accuracy jumps at a seed-dependent step). The result is saved with `save_pretrained` under
`cache_dir/base-<hash>`, the hash covering everything that shapes it, and written atomically
(temp folder, then rename), so a later run loads it in a second.
"""

from __future__ import annotations

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
from nonstop.orchestrator.generate import Codec, exact_match_accuracy, greedy_requests
from nonstop.tasks.data import Example, TaskData
from nonstop.tasks.tiny import make_char_tokenizer, make_tiny_model


def greedy_accuracy(engine: TorchEngine, tokenizer, examples: list[Example], max_new_tokens: int) -> float:
    """Held-out accuracy on an in-process engine, scored exactly like the pipeline's evaluation."""
    codec = Codec(tokenizer)
    return exact_match_accuracy(engine.generate(greedy_requests(examples, codec, max_new_tokens)), examples, codec)


def _cache_key(cfg: Config) -> str:
    shaping = {
        "tiny": cfg.model.tiny.model_dump(), "task": cfg.task.model_dump(exclude={"reward"}),
        "warmup": {**cfg.warmup.model_dump(exclude={"cache_dir"}), "enabled": cfg.warmup_enabled}, "seed": cfg.run.seed,
        "max_new_tokens": cfg.rollout.max_new_tokens, "format": 1,
    }
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]


def _sft(model, tokenizer, data: TaskData, cfg: Config, log: Callable[[str], None]) -> dict:
    w = cfg.warmup
    rng = random.Random(cfg.run.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
    engine = TorchEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    gate = data.eval[: min(len(data.eval), 200)]
    encoded = [
        (tokenizer(ex.prompt)["input_ids"], tokenizer(ex.answer)["input_ids"] + [tokenizer.eos_token_id])
        for ex in data.train
    ]
    acc, step, t0 = 0.0, 0, time.perf_counter()
    while step < w.max_steps:
        model.train()
        batch = rng.sample(encoded, min(w.batch_size, len(encoded)))
        L = max(len(p) + len(a) for p, a in batch)
        ids = torch.full((len(batch), L), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), L), dtype=torch.long)
        for r, (p, a) in enumerate(batch):
            ids[r, : len(p) + len(a)] = torch.tensor(p + a)
            labels[r, len(p): len(p) + len(a)] = torch.tensor(a)
            attn[r, : len(p) + len(a)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % w.eval_every == 0:
            model.eval()
            acc = greedy_accuracy(engine, tokenizer, gate, cfg.rollout.max_new_tokens)
            log(f"warm-up step {step}: loss {loss.item():.3f}, held-out accuracy {acc:.1%}")
            if acc >= w.target_accuracy:
                break
    return {"steps": step, "gate_accuracy": acc, "seconds": time.perf_counter() - t0}


def prepare_base_model(cfg: Config, data: TaskData, log: Callable[[str], None] = print) -> Path:
    """Return the folder of the base policy, building (and caching) it when needed."""
    if cfg.model.path is not None:
        return Path(cfg.model.path)
    root = Path(cfg.warmup.cache_dir)
    folder = root / (f"base-{_cache_key(cfg)}" if cfg.warmup_enabled else f"init-{_cache_key(cfg)}")
    if (folder / "nonstop_base.json").is_file():
        log(f"base policy: cached at {folder}")
        return folder
    quiet_transformers()
    tokenizer = make_char_tokenizer()
    model = make_tiny_model(cfg.model.tiny, cfg.run.seed)
    info: dict = {"warmup": False}
    if cfg.warmup_enabled:
        threads = torch.get_num_threads()
        torch.set_num_threads(2)  # nothing else runs yet: use both cores
        try:
            info = {"warmup": True, **_sft(model, tokenizer, data, cfg, log)}
        finally:
            torch.set_num_threads(threads)
        log(f"warm-up done in {info['seconds']:.1f} s ({info['steps']} steps, gate accuracy {info['gate_accuracy']:.1%})")
    tmp = root / f".tmp-{folder.name}-{time.time_ns()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "nonstop_base.json").write_text(json.dumps(info))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder
