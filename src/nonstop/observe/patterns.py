"""The run doctor's patterns: pure functions over a few summaries of a run's step records.

Each `check_*` returns a `Finding` (what the records show with their numbers, the likely cause,
the settings to try) or None; observe/doctor.py's `Doctor` keeps the summaries they read
(`Point` per step, the first and the newest `Window` of steps, one `Eval` per evaluation) and
reports each finding once. Rewards are read on their own scale, assumed in [0, 1] as the built-in
ones are; the thresholds are the `doctor:` config section (config/flow.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nonstop.config.flow import DoctorConfig


@dataclass(frozen=True, slots=True)
class Finding:
    code: str
    step: int  # the trainer step at which it was first seen
    seen: str  # what the records show, with their numbers
    cause: str  # the likely cause
    tries: tuple[str, ...]  # settings to try, each with why
    cleared: str | None = None  # what later records show that undoes it (None: it still holds)

    def to_dict(self) -> dict[str, Any]:
        out = {"code": self.code, "step": self.step, "seen": self.seen, "cause": self.cause, "try": list(self.tries)}
        return out | ({"cleared": self.cleared} if self.cleared else {})

    def line(self) -> str:
        if self.cleared:
            return f"doctor [{self.code}] of step {self.step} cleared: {self.cleared}"
        return f"doctor [{self.code}] step {self.step}: {self.seen}. Likely: {self.cause}. Try: {'; '.join(self.tries)}"


@dataclass(frozen=True)
class Context:
    """What the doctor knows of the run besides its records: the settings its advice names."""

    max_new_tokens: int
    reward: str = "exact_match"
    group_size: int = 8
    prompts_per_step: int = 32
    lr: float | None = None  # None: read from the step records ("lr")

    @classmethod
    def of(cls, tree: Mapping[str, Any]) -> Context:
        """From a config as a dict (Config.model_dump() or a run folder's config.yaml)."""
        rollout, task, trainer = tree.get("rollout", {}), tree.get("task", {}), tree.get("trainer", {})
        return cls(
            max_new_tokens=int(rollout.get("max_new_tokens", 4)),
            reward=str(task.get("reward", "exact_match")),
            group_size=int(rollout.get("group_size", 8)),
            prompts_per_step=int(rollout.get("prompts_per_step", 32)),
            lr=trainer.get("lr"),
        )


@dataclass(frozen=True, slots=True)
class Point:
    """One step record, reduced to what the checks read: its `rollout_*` fields, over every group
    scored since the step before (trained or dropped: the trained groups alone are a biased sample
    when groups without signal are dropped), and the trainer's clip fraction."""

    step: int
    reward: float  # reward per completion scored (without rollout fields: per completion trained)
    groups: int | None  # groups scored
    signal: int | None  # of them, groups whose rewards differ
    entropy: float | None  # sampled entropy, nats per token
    truncated: float | None  # fraction of completions cut at max_new_tokens
    clip: float | None  # fraction of tokens clipped by the trainer
    sample_accuracy: float | None  # completions that match their answer exactly
    epoch: int  # the newest pass over the train split among the step's groups (0: the first)

    @classmethod
    def of(cls, r: Mapping[str, Any]) -> Point:
        reward = r.get("rollout_reward_mean")
        return cls(
            step=int(r["step"]),
            reward=float(reward if reward is not None else r["reward_mean"]),
            groups=r.get("rollout_groups"),
            signal=r.get("rollout_signal_groups"),
            entropy=r.get("rollout_entropy"),
            truncated=r.get("rollout_truncated_frac"),
            clip=r.get("clip_frac"),
            sample_accuracy=r.get("rollout_exact_frac"),
            epoch=max((int(p[0]) for p in r.get("prompts", ())), default=0),
        )


@dataclass(frozen=True, slots=True)
class Eval:
    step: int
    accuracy: float
    reward: float | None  # mean training reward over the window ending here (None: the base)
    sample_accuracy: float | None


@dataclass(frozen=True)
class Window:
    """Consecutive steps' points."""

    points: Sequence[Point]

    def mean(self, attr: str) -> float | None:
        values = [v for v in (getattr(p, attr) for p in self.points) if v is not None]
        return sum(values) / len(values) if values else None

    def signal_frac(self) -> float | None:
        """Groups with signal among the groups scored in the window."""
        scored = [(p.groups, p.signal) for p in self.points if p.groups is not None and p.signal is not None]
        total = sum(g for g, _ in scored)
        return sum(s for _, s in scored) / total if total else None


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _half_lr(lr: float | None) -> str:
    return f"trainer.lr={lr / 2:.2g}" if lr else "trainer.lr (half of it)"


def check_reward_not_heldout(
    evals: Sequence[Eval], early: Window, ctx: Context, cfg: DoctorConfig, lr: float | None, epochs: int = 0
) -> Finding | None:
    """Since some evaluation (the oldest such: the longest span), at least cfg.min_steps steps and
    cfg.flat_evals evaluations ago, the reward rose by cfg.reward_rise while no held-out accuracy
    after it exceeded its own by cfg.heldout_flat."""
    end = evals[-1]
    if len(evals) < cfg.flat_evals + 1 or end.reward is None or end.accuracy >= cfg.solved_accuracy:
        return None
    best_after = [0.0] * len(evals)  # best_after[i]: the best accuracy of the evaluations after i
    for i in range(len(evals) - 2, -1, -1):
        best_after[i] = max(best_after[i + 1], evals[i + 1].accuracy)
    found = None
    for i in range(len(evals) - cfg.flat_evals):
        start = evals[i]
        r0 = start.reward if start.reward is not None else early.mean("reward")
        if end.step - start.step < cfg.min_steps or r0 is None:
            continue
        if end.reward - r0 >= cfg.reward_rise and best_after[i] - start.accuracy < cfg.heldout_flat:
            found = i, start, r0
            break
    if found is None:
        return None
    i, start, r0 = found
    best = best_after[i]
    seen = (
        f"the training reward rose {r0:.3f} -> {end.reward:.3f} over steps {start.step}-{end.step} while held-out "
        f"accuracy stayed at {_pct(start.accuracy)} -> {_pct(end.accuracy)} (best {_pct(best)})"
    )
    s0 = start.sample_accuracy if start.sample_accuracy is not None else early.mean("sample_accuracy")
    s1 = end.sample_accuracy
    if s0 is not None and s1 is not None and s1 - s0 >= (end.reward - r0) / 2:
        if s1 < end.accuracy + cfg.heldout_flat:
            # the exact-match rate of sampled completions catching up with greedy decoding's: RL
            # sharpening what the policy already answers, which need not move greedy accuracy; a
            # finding only when held-out accuracy never rose over the base's at all
            if max(e.accuracy for e in evals) - evals[0].accuracy >= cfg.heldout_flat:
                return None
            return Finding(
                "reward_not_heldout",
                end.step,
                seen + f"; the sampled completions' exact match rose {_pct(s0)} -> {_pct(s1)}, toward the greedy "
                f"answers', and held-out accuracy never rose {_pct(cfg.heldout_flat)} over the base's",
                "RL only sharpens the answers greedy decoding already gives: the base sits where the reward "
                "rarely tells a right answer from a wrong one on the prompts it gets wrong",
                (
                    "another base: warmup.seed, or a higher warmup.target_accuracy",
                    "a partial credit for parts of the right answer",
                    f"rollout.group_size={2 * ctx.group_size}",
                ),
            )
        passes = f"; each training prompt was drawn about {epochs + 1} times so far" if epochs else ""
        return Finding(
            "reward_not_heldout",
            end.step,
            seen + f"; the training samples' exact match rose {_pct(s0)} -> {_pct(s1)}{passes}",
            "what the policy learns on the training prompts does not carry to held-out ones: it sharpens the "
            "answers it already samples, or learns the training prompts one by one",
            (
                "more distinct training prompts (the dataset)",
                "a base that gets more held-out prompts partly right (warmup.target_accuracy)",
                _half_lr(lr),
            ),
        )
    if s0 is None or s1 is None:  # no exact-match rate of the samples (an environment run)
        return Finding(
            "reward_not_heldout",
            end.step,
            seen,
            "the policy learns the reward or the training prompts, not the task: the reward pays for something "
            "held-out accuracy does not count, or what is learnt on the training prompts does not carry",
            ("a reward that pays only for what held-out accuracy counts", "more distinct training prompts"),
        )
    return Finding(
        "reward_not_heldout",
        end.step,
        seen + f" and the training samples' exact match moved only {_pct(s0)} -> {_pct(s1)}",
        f"the policy learns the reward, not the task: task.reward ({ctx.reward}) pays for something held-out "
        "exact match does not count (a partial credit, a format, a length)",
        (
            "task.reward=exact_match",
            "or a partial credit only for parts of the right answer, well below a right answer's reward",
        ),
    )


def check_signal_collapse(
    early: Window, late: Window, evals: Sequence[Eval], ctx: Context, cfg: DoctorConfig, lr: float | None
) -> Finding | None:
    """Under cfg.signal_min_frac of the newest window's groups had rewards that differ, at most
    cfg.signal_drop of the first window's, while the run is not solving its task."""
    f0, f1 = early.signal_frac(), late.signal_frac()
    if f0 is None or f1 is None or f1 >= cfg.signal_min_frac or f1 > cfg.signal_drop * f0:
        return None
    if evals[-1].accuracy >= cfg.solved_accuracy:
        return None
    step = late.points[-1].step
    seen = f"groups with signal (rewards that differ) fell from {_pct(f0)} to {_pct(f1)} of the groups generated"
    e0, e1 = early.mean("entropy"), late.mean("entropy")
    if e0 is not None and e1 is not None and e1 <= cfg.entropy_drop * e0:
        return Finding(
            "signal_collapse",
            step,
            seen + f"; sampled entropy {e0:.3f} -> {e1:.3f} nats/token",
            "the policy samples the same completion for most prompts: it became confident before it was right",
            (_half_lr(lr), "rollout.temperature=1.2", "trainer.entropy_coef=0.005"),
        )
    return _alike(step, seen, late.mean("reward") or 0.0, evals[-1].accuracy, ctx)


def _alike(step: int, seen: str, reward: float, accuracy: float, ctx: Context) -> Finding:
    """A signal finding whose groups score alike, by how much they score."""
    seen += f"; reward per completion {reward:.3f}"
    if reward >= 0.5:  # rewards in [0, 1]: most groups earn it alike
        return Finding(
            "signal_collapse",
            step,
            seen + f" while held-out accuracy is {_pct(accuracy)}",
            "most completions earn the reward alike: the reward is met without solving the task (it pays for "
            "a format or a length), or the training prompts are learnt",
            ("a reward that pays only for right answers (task.reward)", "more distinct training prompts"),
        )
    return Finding(
        "signal_collapse",
        step,
        seen,
        "most prompts' completions are all wrong alike: the policy is too weak on this task for the reward "
        "to tell its samples apart",
        (
            f"rollout.group_size={2 * ctx.group_size} (more samples find a right one)",
            "a stronger base (warmup.target_accuracy)",
            "a partial credit for parts of the right answer",
        ),
    )


def check_no_step(
    late: Window, pending: Mapping[str, Any], accuracy: float, ctx: Context, cfg: DoctorConfig
) -> Finding | None:
    """At the end of a run: over the newest window's steps and the groups scored after the last one
    (`pending`, the rollout fields of Vitals.take()), at least NO_STEP_BATCHES batches of groups were
    scored and under cfg.signal_min_frac of them had rewards that differ, while the run is not
    solving its task: it waited for batches with signal (few steps, or none, where the window
    checks cannot run)."""
    groups = sum(p.groups or 0 for p in late.points) + (pending.get("rollout_groups") or 0)
    signal = sum(p.signal or 0 for p in late.points) + (pending.get("rollout_signal_groups") or 0)
    if groups < NO_STEP_BATCHES * ctx.prompts_per_step or signal >= cfg.signal_min_frac * groups:
        return None
    if accuracy >= cfg.solved_accuracy:
        return None
    last = late.points[-1].step if late.points else 0
    seen = (
        f"{groups} groups were scored over the last {len(late.points)} trainer steps and after step {last}, "
        f"{signal} of them with rewards that differ: the run waited for batches with signal"
    )
    rewards = [p.reward for p in late.points]
    if pending.get("rollout_reward_mean") is not None:
        rewards.append(float(pending["rollout_reward_mean"]))
    return _alike(last, seen, sum(rewards) / len(rewards) if rewards else 0.0, accuracy, ctx)


NO_STEP_BATCHES = 4
"""check_no_step: groups of this many batches scored without a step make a finding."""


def check_entropy_collapse(
    early: Window, late: Window, evals: Sequence[Eval], cfg: DoctorConfig, lr: float | None
) -> Finding | None:
    """The newest window's sampled entropy fell under cfg.entropy_min and cfg.entropy_drop of the
    first window's, while the run is not solving its task."""
    e0, e1 = early.mean("entropy"), late.mean("entropy")
    if e0 is None or e1 is None or e1 >= cfg.entropy_min or e1 > cfg.entropy_drop * e0:
        return None
    if evals[-1].accuracy >= cfg.solved_accuracy:
        return None
    return Finding(
        "entropy_collapse",
        late.points[-1].step,
        f"sampled entropy fell {e0:.3f} -> {e1:.3f} nats/token while held-out accuracy is {_pct(evals[-1].accuracy)}",
        "the policy became nearly deterministic before it was right: steps too large for the signal",
        (_half_lr(lr), "trainer.entropy_coef=0.005", "rollout.temperature=1.2"),
    )


def check_length_at_limit(early: Window, late: Window, ctx: Context, cfg: DoctorConfig) -> Finding | None:
    """At least cfg.truncated_max_frac of the newest window's completions were cut at max_new_tokens."""
    t0, t1 = early.mean("truncated"), late.mean("truncated")
    if t0 is None or t1 is None or t1 < cfg.truncated_max_frac:
        return None
    n, step = ctx.max_new_tokens, late.points[-1].step
    if t0 >= cfg.truncated_max_frac:
        return Finding(
            "length_at_limit",
            step,
            f"{_pct(t1)} of completions are cut at rollout.max_new_tokens ({n}), {_pct(t0)} from the start",
            "the answers need more tokens than rollout.max_new_tokens allows, so cut completions cannot score",
            (f"rollout.max_new_tokens={2 * n}",),
        )
    return Finding(
        "length_at_limit",
        step,
        f"completions drifted to the limit: {_pct(t0)} -> {_pct(t1)} cut at rollout.max_new_tokens ({n})",
        "the policy writes longer and longer: the reward pays for length or never for stopping",
        (
            "a task.reward that pays for the answer, not its length",
            "trainer.overlong_filter=true (cut completions leave the loss)",
            f"rollout.max_new_tokens={2 * n} if right answers need it",
        ),
    )


def check_ratio_clipping(late: Window, cfg: DoctorConfig, lr: float | None) -> Finding | None:
    """The trainer clipped at least cfg.clip_max_frac of the tokens, averaged over the newest window."""
    c = late.mean("clip")
    if c is None or c < cfg.clip_max_frac:
        return None
    return Finding(
        "ratio_clipping",
        late.points[-1].step,
        f"the trainer clipped the ratio of {_pct(c)} of tokens over the last {len(late.points)} steps",
        "the trainer's policy is far from the one that sampled: steps too large, or rollouts too many versions old",
        (_half_lr(lr), "buffer.depth=0 (on-policy; or a lower buffer.max_lag)"),
    )


def below_base_cleared(evals: Sequence[Eval], base: float, cfg: DoctorConfig) -> str | None:
    """At the end of a run that was found below its base: the newest evaluation above the base by
    cfg.heldout_flat undoes the finding (a dip early in a run that then learnt)."""
    end = evals[-1]
    if len(evals) < 2 or end.accuracy < base + cfg.heldout_flat:
        return None
    return f"held-out accuracy rose to {_pct(end.accuracy)} by step {end.step}, over the base policy's {_pct(base)}"


def check_below_base(evals: Sequence[Eval], base: float, cfg: DoctorConfig, lr: float | None) -> Finding | None:
    """The newest cfg.below_base_evals evaluations (after cfg.min_steps) were all more than
    cfg.below_base under the base's accuracy."""
    newest = evals[1:][-cfg.below_base_evals :]
    if len(newest) < cfg.below_base_evals or newest[-1].step < cfg.min_steps:
        return None
    if any(e.accuracy >= base - cfg.below_base for e in newest):
        return None
    return Finding(
        "below_base",
        newest[-1].step,
        f"held-out accuracy {', '.join(_pct(e.accuracy) for e in newest)} at steps "
        f"{', '.join(str(e.step) for e in newest)}, under the base policy's {_pct(base)}",
        "the updates undo what the base knew: a learning rate too high for this task, or a reward that "
        "disagrees with exact match",
        (_half_lr(lr), "task.reward=exact_match (if it is not)"),
    )
