"""The supervised warm-up: from a fresh tiny model to a weak (not blank) base policy.

RL sharpens what a policy half knows; a blank model gets no reward to learn from. The warm-up
trains the tiny model on the train split (prompt -> answer + EOS, loss on the answer only)
and stops as soon as greedy held-out accuracy on a gate of up to 200 held-out prompts reaches
`target_accuracy` (checked every `eval_every` steps; a fixed step count gives bases of very
different strength, because the accuracy jumps at a seed-dependent step).

The warm-up is chaotic: float results differ between CPU instruction sets (AVX2, AVX-512), so
the same seed ends in different places on different machines. The default job therefore starts
from a base shipped with the package (models/shipped.py); the warm-up serves users' own tasks and
shapes, and rebuilds the shipped base (`nonstop warmup --out DIR`). `cached_warmup` saves its
result under `cache_dir/base-<hash>`, the hash covering everything that shapes it, written
atomically (temp folder, then rename), so a later run loads it in a second.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import multiprocessing as mp
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nonstop.config import Config
from nonstop.engine.core import TorchEngine
from nonstop.hf import quiet_transformers
from nonstop.models.tiny import make_char_tokenizer, make_tiny_model
from nonstop.tasks.codec import Codec, exact_match_accuracy, greedy_requests
from nonstop.tasks.data import Example, TaskData

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


def _sft(
    model,
    tokenizer,
    data: TaskData,
    cfg: Config,
    log: Callable[[str], None],
    seed: int,
    t0: float,
    board: RaceBoard | None = None,
    racer: int = 0,
) -> dict:
    """Supervised steps until the gate. The gate is checked every `eval_every` steps; when a check
    crosses it (and `replay_crossing`), the warm-up goes back to the state of the check before
    (weights, optimiser, batch order) and replays those steps one at a time, checking after each,
    so it stops at the first step at or above the target. In a race (`board`), it also stops as
    soon as its next step could no longer win: checked first, so a crossing since the last check
    is not missed."""
    w = cfg.warmup
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
    engine = TorchEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    gate = data.eval[: min(len(data.eval), GATE_SIZE)]
    encoded = [
        (tokenizer(ex.prompt)["input_ids"], tokenizer(ex.answer)["input_ids"] + [tokenizer.eos_token_id])
        for ex in data.train
    ]
    acc, step, checked, curve = 0.0, 0, 0, []
    limit_s, stopped, replaying = cfg.warmup_time_limit_s, "max_steps", False
    before = _snapshot(model, opt, rng, step) if w.replay_crossing else None
    before_acc = 0.0
    while step < w.max_steps:
        beaten = board is not None and board.beaten(step + 1, racer)
        if beaten and checked == step:
            stopped = "beaten"
            break
        if not beaten:
            model.train()
            batch = rng.sample(encoded, min(w.batch_size, len(encoded)))
            ids, attn, labels = sft_batch(batch, tokenizer.pad_token_id)
            loss = model(input_ids=ids, attention_mask=attn, labels=labels, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        out_of_time = limit_s is not None and time.perf_counter() - t0 >= limit_s
        due = step - checked >= (1 if replaying else w.eval_every)
        if not (due or out_of_time or beaten):
            continue
        model.eval()
        checked = step
        acc = greedy_accuracy(engine, tokenizer, gate, cfg.rollout.max_new_tokens)
        curve.append([step, acc])
        log(f"warm-up step {step}: loss {loss.item():.3f}, held-out accuracy {acc:.1%}")
        if acc >= w.target_accuracy and not replaying and before is not None and not out_of_time:
            step = checked = _restore(model, opt, rng, before)
            acc = before_acc  # what the restored state scored, if a race stops it here
            replaying = True  # replay the crossing's steps one at a time
            continue
        if acc >= w.target_accuracy:
            stopped = "gate"
            if board is not None:
                board.post(step, racer)
            break
        if out_of_time:
            stopped = "max_time_s"
            log(f"warm-up stopped by its time limit ({limit_s:.0f} s) below the gate")
            break
        if not replaying and w.replay_crossing:
            before, before_acc = _snapshot(model, opt, rng, step), acc
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


RACER_SEED_STRIDE = 1000  # racer i's seed is the warm-up seed + 1000 * i


def racer_seed(cfg: Config, racer: int) -> int:
    return warmup_seed(cfg) + RACER_SEED_STRIDE * racer


class RaceBoard:
    """The best gate crossing so far among racers, shared across processes: the smallest (score,
    racer index), where racer 0 (the run's own warm-up seed) scores its crossing step and any other
    racer its step x (1 + `margin`). Lexicographic order makes the winner independent of wall-clock
    timing; the margin keeps the run's own seed unless another crosses clearly earlier."""

    def __init__(self, ctx, margin: float = 0.0) -> None:
        self._best = ctx.Value("q", 2**62)
        self._handicap = round(1000 * margin)  # per mille: the score stays an exact integer

    def score(self, step: int, racer: int) -> int:
        return step * (1000 + (self._handicap if racer else 0))

    def _key(self, step: int, racer: int) -> int:
        return self.score(step, racer) * 64 + racer  # racers <= 8

    def post(self, step: int, racer: int) -> None:
        with self._best.get_lock():
            self._best.value = min(self._best.value, self._key(step, racer))

    def beaten(self, step: int, racer: int) -> bool:
        """True when crossing at `step` could no longer win for `racer`."""
        return self._key(step, racer) > self._best.value


def _racer_main(cfg: Config, data: TaskData, racer: int, board: RaceBoard, t0: float, threads: int, conn) -> None:
    """One racer in its own process: send back (info, weights or None when beaten), or the error."""
    try:
        torch.set_num_threads(threads)
        quiet_transformers()
        seed = racer_seed(cfg, racer)
        model = make_tiny_model(cfg.model.tiny, seed)
        info = _sft(model, make_char_tokenizer(), data, cfg, lambda m: None, seed, t0, board, racer)
        weights = None
        if info["stopped"] != "beaten":  # bytes: the tensors must not outlive this process in shared memory
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            weights = buf.getvalue()
        conn.send((info, weights))
    except BaseException as exc:  # reported by the parent, which goes on with its own racer
        conn.send((None, f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _race(model, tokenizer, data: TaskData, cfg: Config, log: Callable[[str], None], threads: int) -> dict:
    """Racer 0 here, racers 1.. in spawned processes (one per core the actors use later). The winner
    is the smallest (score, racer) of RaceBoard (racers other than 0 handicapped by
    warmup.race_margin); without a crossing, the best accuracy at the limit."""
    ctx = mp.get_context("spawn")
    board, t0, n = RaceBoard(ctx, cfg.warmup.race_margin), time.perf_counter(), cfg.warmup.racers
    others = []
    for racer in range(1, n):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_racer_main,
            args=(cfg, data, racer, board, t0, threads, send),
            name=f"nonstop-warmup-racer-{racer}",
            daemon=True,
        )
        proc.start()
        send.close()
        others.append((racer, proc, recv))
    results: dict[int, tuple[dict, bytes | None]] = {}  # racer -> (info, its weights when not racer 0's)
    try:
        results[0] = (_sft(model, tokenizer, data, cfg, log, warmup_seed(cfg), t0, board, 0), None)
    except BaseException:
        for _, proc, _ in others:
            proc.terminate()
        raise
    for racer, proc, recv in others:
        try:
            info, payload = recv.recv()
        except EOFError:
            proc.join()
            info, payload = None, f"its process ended with exit code {proc.exitcode}"
        proc.join()
        if info is None:
            log(f"warm-up racer {racer} failed and is left out: {payload}")
        else:
            results[racer] = (info, payload)
    crossed = [r for r, (info, _) in results.items() if info["stopped"] == "gate"]
    if crossed:
        winner = min(crossed, key=lambda r: (board.score(results[r][0]["steps"], r), r))
    else:
        alive = [r for r, (info, _) in results.items() if info["stopped"] != "beaten"]
        winner = max(alive, key=lambda r: (results[r][0]["gate_accuracy"], -r))
    info, weights = results[winner]
    if weights is not None:
        model.load_state_dict(torch.load(io.BytesIO(weights), weights_only=True))
    seeds = {r: racer_seed(cfg, r) for r in range(n)}
    info = {
        **info,
        "seed": seeds[winner],
        "racer": winner,
        "racers": [
            {"racer": r, "seed": seeds[r], **{k: i[k] for k in ("stopped", "steps", "gate_accuracy")}}
            for r, (i, _) in sorted(results.items())
        ],
    }
    info["seconds"] = time.perf_counter() - t0
    log(
        f"warm-up race of {n}: racer {winner} (seed {seeds[winner]}) won, {info['stopped']} at step {info['steps']}; "
        + ", ".join(
            f"racer {r['racer']} {r['stopped']} at step {r['steps']}" for r in info["racers"] if r["racer"] != winner
        )
    )
    return info


def warm_up(cfg: Config, data: TaskData, log: Callable[[str], None] = print, threads: int | None = None):
    """A fresh tiny model trained to the accuracy gate on `threads` torch threads (None:
    warmup.threads). With warmup.racers > 1, that many warm-ups of different seeds race (racer i is
    seeded by warmup.seed, else run.seed, plus 1000 * i) and the first to cross the gate, counted in
    steps (another racer's handicapped by warmup.race_margin against racer 0's), is kept. Returns
    (model, tokenizer, info) with info = {stopped, steps, gate_accuracy, gate_size, gate_curve,
    seconds, seed} (+ racer, racers in a race)."""
    threads = cfg.warmup.threads if threads is None else threads
    quiet_transformers()
    tokenizer = make_char_tokenizer()
    model = make_tiny_model(cfg.model.tiny, warmup_seed(cfg))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if cfg.warmup.racers > 1:
            info = _race(model, tokenizer, data, cfg, log, threads)
        else:
            info = _sft(model, tokenizer, data, cfg, log, warmup_seed(cfg), time.perf_counter())
            info["seed"] = warmup_seed(cfg)
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
