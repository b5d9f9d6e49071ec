"""The warm-up of a built-in environment: imitate a weak player, so RL has something to sharpen.

The shipped tiny base knows addition, not these games. `env_base(cfg)` starts from it (a textarena
game: from a fresh tiny model of `model.tiny`'s shape, since the game's messages need more
positions than the shipped base's 128) and trains it on transcripts of a weak player (envs/*.py
`demo`: random guesses, a calculator used in half of the episodes, random Nim moves, a
reasoning-gym answer right 30% of the time, a verifiers taskset's own `demo`, a textarena game's
`WEAK_PLAYERS`), with the loss on the player's tokens only and an EOS after each of its turns, as
the engine writes turns. The result imitates that player: it plays the format and wins
sometimes, by chance, which is the "weak, not blank" base RL needs. The base is cached under
warmup.cache_dir (keyed by the environment, its limits and the seed), so later runs load it in a
second.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nonstop.config import Config, ConfigError
from nonstop.envs.registry import DEMOS, builtin_task, demo_of
from nonstop.hf import load_model, load_tokenizer, quiet_transformers
from nonstop.models.shipped import shipped_dir
from nonstop.models.tiny import make_char_tokenizer, make_tiny_model
from nonstop.models.warmup import save_atomically, warmup_seed

BATCH, LR = 64, 3e-3
STEPS = {"guess_number": 150, "nim": 150, "calculator": 600, "reasoning_gym": 150, "verifiers": 600, "textarena": 800}
"""Optimizer steps per environment: the random players' transcripts are learnt (loss flat) by about
100 steps; the calculator's copying of the tool result takes longer. A reasoning-gym player's loss
is as flat at 150 steps as at 400 (chain_sum: 1.28 and 1.24): the warmed base writes answers in the
format, right by chance, and does not learn the player's 30% right answers in either. A verifiers
taskset's player (its `demo` method) gets the calculator's steps: its tool calls copy too. A textarena
game trains on WINDOW-token windows, cheap steps; Secretary-v0's base read the values after 800
(35.5% held-out, the weak player's 36%) and not after 400 (20.5%, a coin flip): the window phase's
loss drops when the model starts reading, at a step that varies with the data (500 here)."""
FORMATS = {"guess_number": 2, "nim": 2, "calculator": 3, "reasoning_gym": 1, "verifiers": 1, "textarena": 5}
"""Version of each environment's transcripts (part of the cache key): bumped when they change."""


Examples = list[tuple[list[int], list[int]]]
"""(ids, labels) per example; labels are -100 where no loss is taken."""
Plan = list[tuple[int, list[tuple[Examples, int]]]]
"""Phases of (steps, pools), a pool being (examples, batch size): step k of a phase draws its batch
from pool k mod len(pools), so each batch holds one kind of example and is padded to its length only."""


WINDOW = {"textarena": 80}
"""Tokens of context kept before each player move, per environment kind (absent: whole transcripts
only). A textarena game's transcript is hundreds of tokens (Secretary-v0: ~460 with the character
tokenizer, a 340-character prompt first) while the move depends on the game's last message. On whole
transcripts, 100 steps left a fresh tiny model's P([accept]) at 0.60 whatever the value shown (the
moves' marginal). 400 steps on 80-token windows, each a fifth of a whole one's cost, gave 0.25-0.30
below 0.7 and 0.78 above 0.8 (the weak player's 0.25 and 0.75), but in full context the model then
misspelt its moves ('[ccept]': the prompt's own '[accept]' and '[continue]' draw its attention).
Alternating windows with quarter-size batches of whole transcripts from the start kept the spelling
and lost the reading (0.39-0.43 for every value); 300 window steps and then 100 alternating ones
keep both: 0.29-0.36 below 0.7, 0.67-0.75 above 0.8, and 118 of 120 sampled first moves valid."""


def windows(examples: Examples, width: int) -> Examples:
    """Each run of labelled (player) tokens with the `width` tokens before it as context."""
    out = []
    for ids, labels in examples:
        i = 0
        while i < len(labels):
            if labels[i] == -100:
                i += 1
                continue
            j = i
            while j < len(labels) and labels[j] != -100:
                j += 1
            start = max(0, i - width)
            out.append((ids[start:j], [-100] * (i - start) + labels[i:j]))
            i = j
    return out


def transcripts(cfg: Config, tokenizer, count: int, seed: int) -> Examples:
    """(ids, labels) of `count` demo episodes; labels are -100 except on the player's tokens + EOS."""
    assert cfg.env is not None
    demo = demo_of(cfg.env)
    assert demo is not None
    data = builtin_task(cfg.env)
    assert data is not None
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        ids: list[int] = []
        labels: list[int] = []
        for text, by_model in demo(rng.choice(data.train), rng, cfg.env.max_turns):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] + (
                [tokenizer.eos_token_id] if by_model else []
            )
            ids += piece
            labels += piece if by_model else [-100] * len(piece)
        out.append((ids, labels))
    return out


def _train(model, tokenizer, plan: Plan, seed: int, log: Callable[[str], None]) -> float:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model.train()
    loss = torch.tensor(0.0)
    schedule = [pools[k % len(pools)] for count, pools in plan for k in range(count)]
    for step, (examples, size) in enumerate(schedule, 1):
        batch = rng.sample(examples, min(size, len(examples)))
        L = max(len(i) for i, _ in batch)
        ids = torch.full((len(batch), L), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), L), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), L), dtype=torch.long)
        for r, (i, lab) in enumerate(batch):
            ids[r, : len(i)], labels[r, : len(i)], attn[r, : len(i)] = torch.tensor(i), torch.tensor(lab), 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0:
            log(f"env warm-up step {step}: loss {loss.item():.3f}")
    return float(loss.detach())


def env_base(cfg: Config, log: Callable[[str], None] = print, steps: int | None = None) -> Path:
    """The folder of the warmed-up base of a built-in environment (cached)."""
    if cfg.env is None or demo_of(cfg.env) is None:
        raise ConfigError(
            f"env.name: the environment warm-up covers the built-ins {sorted(DEMOS)} and "
            "reasoning_gym/<dataset>; for another environment set model.path to your base policy"
        )
    kind = cfg.env.name.partition("/")[0]
    steps = steps or STEPS[kind]
    shaping = {
        "env": cfg.env.name,
        "max_turns": cfg.env.max_turns,
        "seed": cfg.run.seed,
        "steps": steps,
        "format": FORMATS[kind],
        **({"task_options": cfg.env.task_options, "train_rows": cfg.env.train_rows} if kind != cfg.env.name else {}),
        **({"from": "init", "tiny": cfg.model.tiny.model_dump()} if kind == "textarena" else {}),
    }
    key = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(cfg.warmup.cache_dir) / f"env-{cfg.env.name.replace('/', '-')}-{key}"
    if (folder / "nonstop_base.json").is_file():
        log(f"base policy: cached environment warm-up at {folder}")
        return folder
    quiet_transformers()
    if kind == "textarena":  # a fresh tiny model of model.tiny's shape: positions for a game's long messages
        start_name = "init"
        model, tokenizer = make_tiny_model(cfg.model.tiny, warmup_seed(cfg)), make_char_tokenizer()
    else:
        start = shipped_dir()
        start_name = start.name
        model, tokenizer = load_model(str(start)), load_tokenizer(str(start))
    t0 = time.perf_counter()
    examples = transcripts(cfg, tokenizer, 4096, cfg.run.seed)
    plan: Plan = [(steps, [(examples, BATCH)])]
    if kind in WINDOW:  # windows to learn the moves cheaply, then whole transcripts to play them in full context
        short = windows(examples, WINDOW[kind])
        plan = [(steps * 3 // 4, [(short, BATCH)]), (steps - steps * 3 // 4, [(short, BATCH), (examples, BATCH // 4)])]
    loss = _train(model, tokenizer, plan, cfg.run.seed, log)
    info = {**shaping, "loss": loss, "seconds": round(time.perf_counter() - t0, 1), "from": start_name}
    log(f"env warm-up done in {info['seconds']} s (final loss {loss:.3f})")
    return save_atomically(folder, model.eval(), tokenizer, {"nonstop_base.json": info})
