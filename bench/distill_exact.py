"""Is the per-token distillation term the limit? Sampled estimator vs the exact reverse KL.

bench/distill.py runs the whole pipeline. This runs one synchronous loop in one process (no
engine actor, no buffer, no staleness), so that only the learning signal differs: the shipped
weak student samples `prompts x group` completions of training prompts, and one optimizer step
follows, for `--steps` steps, with the trainer's settings (AdamW, trainer.lr, grad-norm clip):

- reward : GRPO on the exact-match reward (groups whose rewards are all equal dropped, no refill);
- distill: the trainer's distillation path (`distill.task_reward=false`): the teacher actor's
           logprobs of the sampled tokens, advantage -(log pi_student(a_t) - log pi_teacher(a_t)),
           the clipped policy-gradient loss;
- exact  : the exact per-position reverse KL, sum_v pi_student(v) (log pi_student(v) -
           log pi_teacher(v)) over the whole vocabulary, at every completion position of the same
           kind of samples, minimised directly (what the sampled term estimates, without its noise);
- forward: the exact per-position forward KL, sum_v pi_teacher(v) (log pi_teacher(v) -
           log pi_student(v)), on the same student-sampled prefixes (mass-covering, bounded
           per-logit gradients: the teacher's soft labels on the student's own prefixes, as in GKD).

If `distill` learns about as fast as `exact`, the one-sample estimator (and the clips that cap
its large values) costs little, and the student's own learning speed sets the pace.

    python bench/distill_exact.py [--steps 300] [--seed 0] [--every 50] [--signals reward,distill,exact]
                                  [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from nonstop.config import Config, load_config
from nonstop.config.scoring import SHIPPED_TEACHER
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.shipped import shipped_dir
from nonstop.models.warmup import greedy_accuracy
from nonstop.scoring.rewards import exact_match
from nonstop.scoring.teacher import TeacherWorker
from nonstop.tasks.codec import Codec
from nonstop.tasks.data import load_task
from nonstop.trainer.core import Trainer
from nonstop.types import GenerationRequest, Group, SamplingParams

SIGNALS = ("reward", "distill", "exact", "forward")


def sample_groups(engine: TorchEngine, tok, examples, cfg: Config, rng: random.Random) -> list[Group]:
    r = cfg.rollout
    reqs = [
        GenerationRequest(
            i,
            tok(e.prompt)["input_ids"],
            r.group_size,
            SamplingParams(r.max_new_tokens, r.temperature, seed=rng.randrange(1 << 30)),
        )
        for i, e in enumerate(examples)
    ]
    groups = []
    for i, (e, samples) in enumerate(zip(examples, engine.generate(reqs))):
        for s in samples:
            s.reward = exact_match(Codec(tok).decode(s.completion_ids), e.answer)
        groups.append(Group(i, e.prompt, e.answer, samples))
    return groups


def exact_step(
    model, teacher, opt: torch.optim.Optimizer, groups: list[Group], cfg: Config, forward: bool = False
) -> float:
    """One step on the exact per-position reverse (or forward) KL, averaged over the completion tokens."""
    seqs = [(s.prompt_ids, s.completion_ids) for g in groups for s in g.samples]
    L = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros((len(seqs), L), dtype=torch.long)  # (B, L) right-padded
    predicts = torch.zeros((len(seqs), L), dtype=torch.bool)  # (B, L) positions that predict a completion token
    for i, (p, c) in enumerate(seqs):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        predicts[i, len(p) - 1 : len(p) - 1 + len(c)] = True
    t = cfg.rollout.temperature
    student = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float() / t, -1)  # (B, L, V)
    with torch.no_grad():
        teach = torch.log_softmax(teacher(input_ids=ids, use_cache=False).logits.float() / t, -1)
    if forward:
        kl = (teach.exp() * (teach - student)).sum(-1)  # (B, L)
    else:
        kl = (student.exp() * (student - teach)).sum(-1)  # (B, L)
    loss = kl[predicts].mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm)
    opt.step()
    return float(loss.detach())


def run(signal: str, cfg: Config, steps: int, seed: int, every: int) -> list[tuple[int, float, float]]:
    """(step, held-out accuracy, teacher KL) every `every` steps."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    data = load_task(cfg.task)
    student_dir = str(shipped_dir("builtin_weak"))
    tok = load_tokenizer(student_dir)
    model = load_model(student_dir)
    engine = TorchEngine(model, [tok.eos_token_id], tok.pad_token_id)
    worker = TeacherWorker(str(SHIPPED_TEACHER), cfg.rollout.temperature, 1024)
    distill = cfg.distill.model_copy(update={"teacher": str(SHIPPED_TEACHER), "task_reward": False})
    trainer = Trainer(
        model, cfg.trainer, cfg.rollout.temperature, tok.pad_token_id, distill=distill if signal == "distill" else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.trainer.learning_rate, weight_decay=cfg.trainer.weight_decay)
    curve, kl = [], float("nan")
    for step in range(1, steps + 1):
        model.eval()
        groups = sample_groups(engine, tok, rng.sample(data.train, cfg.rollout.prompts_per_step), cfg, rng)
        model.train()
        if signal == "reward":
            groups = [g for g in groups if len({s.reward for s in g.samples}) > 1]
            if groups:
                trainer.step(groups)
        elif signal == "distill":
            samples = [s for g in groups for s in g.samples]
            for s, lp in zip(samples, worker.logprobs([(s.prompt_ids, s.completion_ids) for s in samples])):
                s.teacher_logprobs = lp
            metrics = trainer.step(groups)
            assert isinstance(metrics["teacher_kl"], float)
            kl = metrics["teacher_kl"]
        else:
            kl = exact_step(model, worker.model, opt, groups, cfg, forward=signal == "forward")
        if step % every == 0 or step == steps:
            model.eval()
            curve.append((step, greedy_accuracy(engine, tok, data.eval, cfg.rollout.max_new_tokens), kl))
            print(f"{signal:>8} step {step}: held-out {curve[-1][1]:.1%}, teacher KL {kl:.2f}", flush=True)
    return curve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--every", type=int, default=50, help="held-out evaluation every this many steps")
    ap.add_argument("--signals", default="reward,distill,exact", help=f"a subset of {','.join(SIGNALS)}")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ns = ap.parse_args()
    cfg = load_config(overrides=["model.base=builtin_weak", *ns.sets])
    torch.set_num_threads(1)
    curves, walls = {}, {}
    signals = [x for x in ns.signals.split(",") if x]
    if not signals or set(signals) - set(SIGNALS):
        ap.error(f"--signals: a comma-separated subset of {','.join(SIGNALS)}")
    for signal in signals:
        t0 = time.perf_counter()
        curves[signal] = run(signal, cfg, ns.steps, ns.seed, ns.every)
        walls[signal] = time.perf_counter() - t0
    print(
        f"\nStudent: shipped weak base; teacher: shipped; {ns.steps} synchronous steps of "
        f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} samples; lr {cfg.trainer.lr:g}; seed {ns.seed}"
    )
    steps = [s for s, _, _ in curves[signals[0]]]
    print(f"{'signal':>8} " + " ".join(f"{s:>6}" for s in steps) + f" {'KL last':>8} {'s':>5}")
    for signal, curve in curves.items():
        kl = "-" if signal == "reward" else f"{curve[-1][2]:.2f}"
        print(f"{signal:>8} " + " ".join(f"{a:>6.1%}" for _, a, _ in curve) + f" {kl:>8} {walls[signal]:>5.0f}")
    final = {signal: curve[-1][1] for signal, curve in curves.items()}
    print("RESULT " + " ".join(f"acc_{signal}={acc:.3f}" for signal, acc in final.items()))


if __name__ == "__main__":
    main()
