"""Building a run's scoring stage from its config: which components, in which runner.

`build_scorer(cfg, backend, decode, reward, log)` resolves everything it can before any actor
starts, so a bad name or a teacher with another tokenizer is one clear error at start-up:
task.reward (or the Python callable `reward` from nonstop.api), scoring.group_reward,
scoring.process_reward, scoring.reward_model, scoring.judge and distill.teacher. With
`scoring.pool: process` a function must reach the worker processes: a name travels as text, a
Python callable only if it pickles (a module-level function); a lambda or closure is refused
with the fix (pool 'auto' keeps such a function on threads).
`decode` turns completion token ids into text (the process-reward step split).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nonstop.config import Config
from nonstop.runtime.base import ActorBackend
from nonstop.scoring.base import ScoreComponent
from nonstop.scoring.judge import JudgeComponent
from nonstop.scoring.process import ProcessRewardComponent
from nonstop.scoring.reward_model import RewardModelComponent
from nonstop.scoring.rewards import RewardError, resolve_reward
from nonstop.scoring.runners import make_runner, shippable
from nonstop.scoring.stage import FunctionComponent, ScoringStage
from nonstop.scoring.teacher import TeacherComponent, check_tokenizers


def _shippable(spec: str | Callable[..., Any], field: str, pool: str) -> str | Callable[..., Any]:
    """What travels to a reward worker with pool 'process': the name, or a callable that pickles.
    (Pool 'auto' keeps a function that does not pickle on threads.)"""
    if pool == "process" and not shippable(spec):
        raise RewardError(
            f"{field}: {spec!r} cannot be sent to worker processes (it does not pickle); "
            "define it at module level in an importable module, or set scoring.pool=thread"
        )
    return spec


def build_scorer(
    cfg: Config,
    backend: ActorBackend | None,
    decode: Callable[[list[int]], str],
    reward: Callable[..., Any] | None = None,
    log: Callable[[str], None] = print,
    tokenizer_dir: str | None = None,
) -> ScoringStage:
    """The stage of this config. `reward` replaces task.reward; `tokenizer_dir` is the student's
    tokenizer, which a distillation teacher must share."""
    sc = cfg.scoring
    runner = make_runner(sc, backend, log)
    spec: str | Callable[..., Any] = reward if reward is not None else cfg.task.reward
    fn = reward if reward is not None else resolve_reward(cfg.task.reward)
    components: list[ScoreComponent] = [
        FunctionComponent("reward", _shippable(spec, "reward", sc.pool), fn, runner, sc.timeout_s)
    ]
    if sc.group_reward is not None:
        group_fn = resolve_reward(sc.group_reward, "scoring.group_reward")
        components.append(
            FunctionComponent(
                "group_reward", sc.group_reward, group_fn, runner, sc.timeout_s, sc.group_reward_weight, kind="group"
            )
        )
    if sc.process_reward is not None:
        pr = sc.process_reward
        components.append(
            ProcessRewardComponent(pr, resolve_reward(pr.fn, "scoring.process_reward.fn"), runner, sc.timeout_s, decode)
        )
    if sc.reward_model is not None:
        if backend is None:
            raise RewardError("scoring.reward_model: needs an actor backend")
        components.append(RewardModelComponent(sc.reward_model, backend, log, sc.timeout_s))
    if sc.judge is not None:
        components.append(JudgeComponent(sc.judge, sc.timeout_s))
    if cfg.distill.teacher is not None:
        if backend is None or tokenizer_dir is None:
            raise RewardError("distill.teacher: needs an actor backend and the student's tokenizer")
        check_tokenizers(tokenizer_dir, cfg.distill.teacher)
        components.append(TeacherComponent(cfg.distill, cfg.rollout.temperature, backend, log, sc.timeout_s))
    return ScoringStage(components, sc, runner, cfg.task.reward_fail_fast)
