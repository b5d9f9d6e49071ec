"""Trainer time per real token: heavy-tailed batch vs uniform batch of the same token count.

Two batches of the long-rollout task (nonstop.tasks.long_rollout), 8 prompts x 8 completions:
- heavy: 64 worked solutions of train rows drawn at random (lengths as the task draws them:
  median about 85 tokens, some several hundred);
- uniform: 64 completions cut to one length, the heavy batch's mean, so both hold the same
  number of real completion tokens (within 64).
Each is trained on with the padded shared-prompt forward (trainer.packed false) and the
padding-free one (trainer.packed true): `Trainer.step` (forward, loss, backward, AdamW), the
median of --repeats timed steps after one warm-up step, on --threads torch threads. The model is
the shipped long-rollout base (its shape and weights) when present.

Prints per arm the seconds per step and microseconds per real token, then
`RESULT padded_ratio=... packed_ratio=... packed_speedup_heavy=...` where a ratio is heavy time
per real token over uniform time per real token (1.0: the tail costs nothing extra).

    python bench/packed_trainer.py [--threads 1] [--repeats 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from nonstop.config import TaskConfig, TrainerConfig
from nonstop.hf import load_model, load_tokenizer, quiet_transformers
from nonstop.models.shipped import ASSETS, TASK_BASES
from nonstop.tasks import long_rollout as task
from nonstop.tasks.data import load_task
from nonstop.trainer.core import Trainer
from nonstop.types import Group, Sample


def batch_groups(tok, prompts, solutions, n: int, cut: int | None, rng: random.Random) -> list[Group]:
    """len(prompts) groups of n completions each; completions drawn at random from `solutions`
    (all cut to `cut` tokens when given)."""
    groups = []
    for g, prompt in enumerate(prompts):
        p = tok(prompt)["input_ids"]
        samples = []
        for j in range(n):
            c = tok(rng.choice(solutions))["input_ids"] + [tok.eos_token_id]
            c = c[:cut] if cut is not None else c
            lp = [-0.1] * len(c)
            samples.append(Sample(p, c, lp, [0] * len(c), "stop", reward=float(j % 2)))
        groups.append(Group(g, "", "", samples))
    return groups


def time_steps(model_dir: str, arms: dict[str, list[Group]], packed: bool, repeats: int) -> dict[str, float]:
    """Median seconds of one Trainer.step per arm; the arms take turns, so drift in the machine's
    load (it is shared) falls on all of them alike."""
    trainers = {
        name: Trainer(load_model(model_dir), TrainerConfig(packed=packed), temperature=1.0, pad_token_id=0)
        for name in arms
    }
    for name, groups in arms.items():
        trainers[name].step(groups)  # warm-up: allocator, first-call costs
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(repeats):
        for name, groups in arms.items():
            t0 = time.perf_counter()
            trainers[name].step(groups)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ns = ap.parse_args()
    quiet_transformers()
    torch.set_num_threads(ns.threads)
    model_dir = str(ASSETS / TASK_BASES[task.NAME])
    tok = load_tokenizer(model_dir)
    data = load_task(TaskConfig(name=task.NAME))
    rng = random.Random(ns.seed)
    pool = [(ex.prompt, ex.answer) for ex in rng.sample(data.train, 2000)]
    prompts = [p for p, _ in pool[: ns.prompts]]

    heavy = batch_groups(tok, prompts, [s for _, s in pool], ns.group_size, None, random.Random(ns.seed))
    lengths = [len(s.completion_ids) for g in heavy for s in g.samples]
    mean = round(sum(lengths) / len(lengths))
    long_enough = [s for _, s in pool if len(tok(s)["input_ids"]) + 1 >= mean]
    uniform = batch_groups(tok, prompts, long_enough, ns.group_size, mean, random.Random(ns.seed))
    real = {"heavy": sum(lengths), "uniform": sum(len(s.completion_ids) for g in uniform for s in g.samples)}
    print(
        f"heavy batch: {real['heavy']} completion tokens, lengths median {sorted(lengths)[len(lengths) // 2]}, "
        f"max {max(lengths)} (padded to {len(heavy[0].samples) * len(heavy) * max(lengths)}); "
        f"uniform batch: {real['uniform']} tokens, every completion {mean}"
    )
    per_token: dict[tuple[str, bool], float] = {}
    for packed in (False, True):
        for name, s in time_steps(model_dir, {"uniform": uniform, "heavy": heavy}, packed, ns.repeats).items():
            per_token[(name, packed)] = s / real[name]
            print(
                f"{'packed' if packed else 'padded'} {name:8s}: {s:.3f} s/step, "
                f"{1e6 * s / real[name]:.1f} us per real token",
                flush=True,
            )
    ratio = {p: per_token[("heavy", p)] / per_token[("uniform", p)] for p in (False, True)}
    print(
        f"RESULT padded_ratio={ratio[False]:.2f} packed_ratio={ratio[True]:.2f} "
        f"packed_speedup_heavy={per_token[('heavy', False)] / per_token[('heavy', True)]:.2f}"
    )


if __name__ == "__main__":
    main()
