"""MoE routing replay: a tiny Qwen3-MoE trained with a bf16 engine and an fp32 trainer, without and with R3.

The engine (the built-in one, its model in bfloat16) and the trainer (float32) route the same
tokens differently; Keep Routing (trainer.routing_replay r3) makes the trainer use the engine's
experts. Both arms start from the same warmed-up base (a supervised warm-up of the MoE model
on addition, cached in .nonstop_cache), train synchronously (depth 0: generate a batch, score,
one trainer step, copy the new weights into the engine, cast to bf16) for the same number of
steps with the same seed, and report per arm:
- `free mism.`: mean over steps of routing_free_mismatch_frac, the fraction of routed tokens whose
  expert set as the trainer's own router chooses it (top-k of its logits) differs from the
  engine's in at least one layer: measured in both arms (under r3, given the replayed earlier
  layers): zero only where the routers agree, in either arm;
- `replayed`: routing_replayed_frac, the fraction of routed tokens whose experts the trainer's
  forward actually computed with (read at each experts module) equal the engine's in every
  layer; the mean and the worst step. 1.000 on every step is the evidence that r3 applied;
  without replay it is 1 - free mismatch;
- the std of the per-token log importance ratio log pi - log mu, and the held-out greedy
  accuracy (engine, bf16) before and after. Timings are of whatever else runs on the machine.

    python bench/moe.py [--quick] [--steps N] [--seed S] [--base DIR] [--set KEY=VALUE ...]

`--base DIR` starts from a base already written by `nonstop warmup examples/moe_r3.yaml --out DIR`
instead of the cached warm-up.

Last line: RESULT free_mismatch_none=.. free_mismatch_r3=.. replayed_none=.. replayed_min_r3=..
ratio_std_none=.. ratio_std_r3=.. gain_none=.. gain_r3=.. (points)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from nonstop.config import Config, load_config
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.warmup import cached_base
from nonstop.scoring.rewards import exact_match
from nonstop.tasks.codec import Codec, exact_match_accuracy, greedy_requests
from nonstop.tasks.data import load_task
from nonstop.trainer.core import Trainer
from nonstop.types import GenerationRequest, Group, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def run_arm(cfg: Config, base: Path, replay: str, steps: int, eval_size: int, seed: int) -> dict:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    data = load_task(cfg.task, cfg.task.split_seed)
    tokenizer = load_tokenizer(str(base))
    codec = Codec(tokenizer)
    engine_model = load_model(str(base), dtype=torch.bfloat16)
    engine = TorchEngine(engine_model, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    trainer_cfg = cfg.trainer.model_copy(update={"routing_replay": replay})
    trainer = Trainer(
        load_model(str(base)), trainer_cfg, cfg.rollout.temperature, tokenizer.pad_token_id, total_steps=steps
    )
    held_out = data.eval[:eval_size]
    r = cfg.rollout

    def accuracy() -> float:
        return exact_match_accuracy(
            engine.generate(greedy_requests(held_out, codec, r.max_new_tokens)), held_out, codec
        )

    before, mismatch, replayed, spread, t0 = accuracy(), [], [], [], time.perf_counter()
    for step in range(steps):
        examples = rng.sample(data.train, r.prompts_per_step)
        params = SamplingParams(r.max_new_tokens, r.temperature, seed=rng.randrange(1 << 30))
        results = engine.generate(
            [GenerationRequest(i, codec.encode(ex.prompt), r.group_size, params) for i, ex in enumerate(examples)]
        )
        groups = []
        for i, (ex, samples) in enumerate(zip(examples, results)):
            for s in samples:
                s.reward = exact_match(codec.decode(s.completion_ids), ex.answer)
            if len({s.reward for s in samples}) > 1:  # GRPO learns only from groups with both outcomes
                groups.append(Group(i, ex.prompt, ex.answer, samples))
        if not groups:
            continue
        metrics = trainer.step(groups)
        free, used, std = (
            metrics["routing_free_mismatch_frac"],
            metrics["routing_replayed_frac"],
            metrics["log_ratio_std"],
        )
        assert isinstance(free, float) and isinstance(used, float) and isinstance(std, float)  # reported as floats
        mismatch.append(free)
        replayed.append(used)
        spread.append(std)
        with torch.no_grad():  # depth 0: the engine holds the trainer's new weights, in bf16
            for p_engine, p_trainer in zip(engine_model.parameters(), trainer.model.parameters()):
                p_engine.copy_(p_trainer)
        engine.scheduler.policy_version = trainer.policy_version
    train_s = time.perf_counter() - t0
    after = accuracy()
    return {
        "replay": replay,
        "mismatch": statistics.mean(mismatch),
        "replayed": statistics.mean(replayed),
        "replayed_min": min(replayed),
        "ratio_std": statistics.mean(spread),
        "before": before,
        "after": after,
        "gain": after - before,
        "steps": len(mismatch),
        "train_s": train_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps and a smaller held-out set (<= 6 minutes)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=str(ROOT / "examples" / "moe_r3.yaml"))
    ap.add_argument("--base", default=None, help="a base policy folder (nonstop warmup --out DIR)")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides on top of --config, e.g. model.tiny.moe.num_experts=32",
    )
    ns = ap.parse_args()
    torch.set_num_threads(1)
    steps = ns.steps or (30 if ns.quick else 120)
    eval_size = 200 if ns.quick else 500
    cfg = load_config(ns.config, [f"run.seed={ns.seed}", f"warmup.cache_dir={ROOT / '.nonstop_cache'}", *ns.overrides])
    t0 = time.perf_counter()
    base = Path(ns.base) if ns.base else cached_base(cfg, load_task(cfg.task, cfg.task.split_seed), warmup=True)
    print(f"base: {base} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(
        f"{'routing_replay':>14} {'free mism.':>10} {'replayed':>8} {'(worst)':>8} {'ratio std':>10} {'before':>7} "
        f"{'after':>7} {'gain':>7} {'steps':>6} {'train s':>8}"
    )
    arms = {}
    for replay in ("none", "r3"):
        a = arms[replay] = run_arm(cfg, base, replay, steps, eval_size, ns.seed)
        print(
            f"{replay:>14} {a['mismatch']:>10.3f} {a['replayed']:>8.3f} {a['replayed_min']:>8.3f} "
            f"{a['ratio_std']:>10.4f} {a['before']:>7.1%} {a['after']:>7.1%} {100 * a['gain']:>+6.1f}p {a['steps']:>6} "
            f"{a['train_s']:>8.1f}",
            flush=True,
        )
    print(
        f"RESULT free_mismatch_none={arms['none']['mismatch']:.3f} free_mismatch_r3={arms['r3']['mismatch']:.3f} "
        f"replayed_none={arms['none']['replayed']:.3f} replayed_min_r3={arms['r3']['replayed_min']:.3f} "
        f"ratio_std_none={arms['none']['ratio_std']:.4f} ratio_std_r3={arms['r3']['ratio_std']:.4f} "
        f"gain_none={100 * arms['none']['gain']:.1f} gain_r3={100 * arms['r3']['gain']:.1f}"
    )


if __name__ == "__main__":
    main()
