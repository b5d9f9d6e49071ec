"""A two-role environment for tests of separate policies (env.policies): roles 'a' and 'b' each
write `TURNS` turns, alternately, whatever they write, so both roles always produce model tokens.
A turn scores +1 when its first character has an even code point, else -1 (an empty turn -1):
random for a random tiny model, so groups carry signal for both roles. `duel_args(...)` are the
`nonstop train` arguments of a short run of it with role 'b' on its own policy."""

from __future__ import annotations

from pathlib import Path

from nonstop.envs.base import Tool, Turn
from nonstop.tasks.data import Example

TURNS = 2


class Duel:
    roles = ("a", "b")
    tools: dict[str, Tool] = {}

    def __init__(self) -> None:
        self.turns = 0

    async def reset(self, row: Example) -> Turn:
        self.turns = 0
        return Turn({"a": "a?", "b": "b?"}, "a")

    async def step(self, role: str, action: str) -> Turn:
        self.turns += 1
        reward = 1.0 if action and ord(action[0]) % 2 == 0 else -1.0
        other = "b" if role == "a" else "a"
        if self.turns >= 2 * TURNS:
            return Turn({}, None, {role: reward}, {"success": reward > 0})
        return Turn({other: ":"}, other, {role: reward})


def duel_args(tiny_dir: Path, out_dir: Path, steps: int, checkpoint_every: int | None = None, *extra: str) -> list[str]:
    """`nonstop train` arguments: Duel for `steps` shared-policy steps, role 'b' on its own policy
    (lr 0.003), 4 rows x 2 episodes a step, the run in out_dir/duel; `extra` are more arguments."""
    from support.cli import sets, small_model_args

    duel = {
        "env.name": "support.two_role_env:Duel",
        "env.max_turns": TURNS,
        "env.turn_max_tokens": 3,
        "env.max_episode_tokens": 48,
        "env.eval_name": None,
        "env.policies.b.lr": 0.003,
        "task.eval_size": 8,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 2,
        "run.max_steps": steps,
        "run.eval_every": steps,
        "checkpoint.every_steps": checkpoint_every,
        "run.out_dir": out_dir,
        "run.name": "duel",
    }
    return [*sets(duel), *small_model_args(tiny_dir), *extra]
