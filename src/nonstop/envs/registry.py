"""Environments by name: the built-ins and 'package.module:factory', their task rows and limits.

`env_factory(name, field)` returns a callable that makes a fresh environment per episode, as a
`MultiAgentEnvironment` (single-agent environments wrapped in `SingleAgent`). Built-ins:

| name            | kind                   | rows (answer column)        | evaluation              |
|-----------------|------------------------|-----------------------------|-------------------------|
| `guess_number`  | multi-turn game        | hidden number 1..7          | success rate            |
| `calculator`    | tool use (`calc`)      | product of the prompt       | success rate            |
| `nim`           | self-play, 2 roles     | 'pile,side'                 | win rate vs `nim_vs_random` |
| `nim_vs_random` | the policy vs a random mover | 'pile,side'           | win rate                |
| `reasoning_gym/<dataset>` | a reasoning-gym generator (optional extra) | question, answer | score 1 |
| `textarena/<game id>` | a textarena game, one role per player (optional extra) | game id, seed | player_0's win rate |
| `verifiers/<module:factory>` | a verifiers.v1 Taskset (optional extra) | task prompt, position | reward >= 1 |

The textarena adapter is envs/textarena_env.py; the verifiers one, envs/verifiers/env.py, plays
the Taskset through verifiers' train client.

`builtin_task(cfg)` generates a built-in's train rows (seed 1) and held-out rows (seed 2);
a custom environment reads its rows from the task section like single-turn prompts do.
`limits(cfg)` is the section's `EnvLimits`.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from types import ModuleType

from nonstop.config import ConfigError, EnvConfig
from nonstop.config.specs import import_callable
from nonstop.envs import calculator, guess, nim, reasoning_gym
from nonstop.envs.base import EnvLimits, MultiAgentEnvironment, SingleAgent
from nonstop.tasks.data import DatasetReport, Example, TaskData

VERIFIERS = "verifiers/"
TEXTARENA = "textarena/"

Demo = Callable[[Example, random.Random, int], list[tuple[str, bool]]]

_BUILTIN: dict[str, Callable[[], object]] = {
    "guess_number": guess.GuessNumber,
    "calculator": calculator.Calculator,
    "nim": nim.Nim,
    "nim_vs_random": nim.NimVsScripted,
}
_ROWS: dict[str, Callable[[int, int], list[Example]]] = {
    "guess_number": guess.rows,
    "calculator": calculator.rows,
    "nim": nim.rows,
    "nim_vs_random": nim.rows,
}
DEMOS: dict[str, Demo] = {"guess_number": guess.demo, "calculator": calculator.demo, "nim": nim.demo}
"""Built-in transcripts of a weak player, for the supervised warm-up (models/env_warmup.py)."""


def _textarena() -> ModuleType:
    # optional: the textarena extra (the module raises a ConfigError naming it where it is missing)
    from nonstop.envs import textarena_env

    return textarena_env


def _verifiers() -> ModuleType:
    # optional: the verifiers extra (imported only by a run whose env.name is verifiers/...)
    from nonstop.envs.verifiers import env as verifiers_env

    return verifiers_env


def _resolve(name: str, field: str, cfg: EnvConfig | None = None) -> Callable[[], object]:
    if name in _BUILTIN:
        return _BUILTIN[name]
    if name.startswith(VERIFIERS):
        raise ConfigError(
            f"{field}: {name!r}: a verifiers taskset is played as a whole run's env.name, "
            "not as an environment of another run (e.g. env.eval_name)"
        )
    if name.startswith(TEXTARENA):
        return _textarena().factory(name)
    if name.startswith(reasoning_gym.PREFIX):
        task = _reasoning_gym_task(name, cfg)
        return lambda: reasoning_gym.ReasoningGymEnv(task)
    return import_callable(name, field, ConfigError, "environment", _BUILTIN)


def as_multi_agent(env: object, field: str = "env.name") -> MultiAgentEnvironment:
    if hasattr(env, "roles"):
        return env  # type: ignore[return-value]
    if not (
        inspect.iscoroutinefunction(getattr(env, "reset", None))
        and inspect.iscoroutinefunction(getattr(env, "step", None))
    ):
        raise ConfigError(
            f"{field}: {type(env).__name__} is no environment: it needs async reset() and step() "
            "(nonstop.envs.base.Environment or MultiAgentEnvironment)"
        )
    return SingleAgent(env)  # type: ignore[arg-type]  # checked above: async reset and step


def _reasoning_gym_task(name: str, cfg: EnvConfig | None) -> reasoning_gym.ReasoningGymTask:
    cfg = cfg or EnvConfig(name=name)
    return reasoning_gym.ReasoningGymTask(
        name.removeprefix(reasoning_gym.PREFIX), cfg.train_rows, cfg.eval_rows, cfg.task_options
    )


def demo_of(cfg: EnvConfig) -> Demo | None:
    """The weak player whose transcripts warm up a base for `cfg.name` (models/env_warmup.py); None: no warm-up."""
    if cfg.name.startswith(reasoning_gym.PREFIX):
        data = builtin_task(cfg)
        assert data is not None
        answers = [r.answer for r in data.train]
        return lambda row, rng, max_turns: reasoning_gym.demo(row, rng, max_turns, answers)
    if cfg.name.startswith(VERIFIERS):
        return _verifiers().demo(cfg)  # a taskset's own `demo` method, when it has one
    if cfg.name.startswith(TEXTARENA):
        textarena_env = _textarena()
        game = cfg.name.removeprefix(TEXTARENA)
        if game not in textarena_env.WEAK_PLAYERS or textarena_env.players(game) != 1:
            return None
        return lambda row, rng, max_turns: textarena_env.demo(game, row, rng, max_turns)
    return DEMOS.get(cfg.name)


def env_factory(
    name: str, field: str = "env.name", cfg: EnvConfig | None = None
) -> Callable[[], MultiAgentEnvironment]:
    """`cfg` sizes the rows of a task source (reasoning_gym/...); built-ins ignore it."""
    factory = _resolve(name, field, cfg)
    as_multi_agent(factory(), field)  # fail at start, naming the field, not in the first episode
    return lambda: as_multi_agent(factory(), field)


def eval_name(cfg: EnvConfig) -> str:
    if cfg.eval_name is not None:
        return cfg.eval_name
    return "nim_vs_random" if cfg.name == "nim" else cfg.name


def builtin_task(cfg: EnvConfig) -> TaskData | None:
    """Train and held-out rows of a built-in environment or a task source; None for a custom one."""
    if cfg.name.startswith(VERIFIERS):
        return _verifiers().task_data(cfg)
    if cfg.name.startswith(TEXTARENA):
        textarena_env = _textarena()
        game = cfg.name.removeprefix(TEXTARENA)
        return TaskData(
            textarena_env.rows(game, cfg.train_rows, 1),
            textarena_env.rows(game, cfg.eval_rows, 2),
            DatasetReport(rows_read=cfg.train_rows + cfg.eval_rows),
        )
    if cfg.name.startswith(reasoning_gym.PREFIX):
        task = _reasoning_gym_task(cfg.name, cfg)
        return TaskData(task.rows(0), task.rows(1), DatasetReport(rows_read=cfg.train_rows + cfg.eval_rows))
    rows = _ROWS.get(cfg.name)
    if rows is None:
        return None
    return TaskData(
        rows(cfg.train_rows, 1), rows(cfg.eval_rows, 2), DatasetReport(rows_read=cfg.train_rows + cfg.eval_rows)
    )


def limits(cfg: EnvConfig) -> EnvLimits:
    return EnvLimits(cfg.max_turns, cfg.max_episode_tokens, cfg.turn_max_tokens, cfg.step_timeout_s)
