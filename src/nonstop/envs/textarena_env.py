"""textarena games as multi-agent environments: each player a role, the game engine the referee.

`env.name: textarena/<game id>` (e.g. `textarena/Nim-v0`, `textarena/TicTacToe-v0`) plays a
registered textarena game (its `-raw` registration: no wrappers, so no observation is ever
repeated) as a `MultiAgentEnvironment` with roles `player_0` .. `player_<n-1>`. The task row's
answer is the game's seed (`rows()`), so an episode can be reproduced.

Each role's sequence receives, in order, exactly the messages textarena addressed to that
player since the role last heard from the game (its prompt and board first, then the
opponents' moves, the referee's messages, invalid-move notices), each as
`[<sender>] <message>\\n` with textarena's own role names, the way its LLM observation wrapper
writes them. A role's turn is the text its model wrote, handed to `env.step` unchanged; the game
decides who acts next (an invalid move is retried by the same player, within textarena's error
allowance). When the game is done, `env.close()` gives every player's reward (zero-sum games:
+1 / -1, a draw 0), and the episode ends with them and textarena's `game_info` as metadata.

With several roles the run uses the per-role EMA baseline by default (episode_flow.py), as the
built-in Nim self-play does. A single-player game (textarena's `SinglePlayerState`: Guess the
Number, Blackjack, Frozen Lake, ...) is one role, `player_0`, against the game itself; how many
players a game takes is what its state accepts (`players()`, probed once). Optional extra:
`pip install 'nonstop[textarena]'` (textarena 0.7.4 pulls no torch; its games draw from the
process-global `random`, which textarena seeds from the row's seed at reset).

The warm-up (models/env_warmup.py) of a single-player game with a weak player in `WEAK_PLAYERS` plays
the real game with that player (`demo`): its transcripts are what the episodes will look like,
the game's own messages included, so a base warmed up on them plays the format and wins
sometimes, and RL has the game's feedback to sharpen it ("weak, not blank": a player that never
looks at the game gave Secretary-v0 a base RL could not move, see docs/environments.md).
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable
from typing import Any

from nonstop.config import ConfigError
from nonstop.envs.base import Tool, Turn
from nonstop.tasks.data import Example

PREFIX = "textarena/"

try:
    import textarena as ta
except ImportError as e:
    raise ConfigError(
        f"env.name: textarena games need the textarena extra: pip install 'nonstop[textarena]' ({e})"
    ) from None


def role(player_id: int) -> str:
    return f"player_{player_id}"


class TextArenaGame:
    """One textarena game per episode (make a new one for each: the game keeps its state)."""

    tools: dict[str, Tool] = {}

    def __init__(self, game_id: str, num_players: int = 2) -> None:
        try:
            self.env = ta.make(f"{game_id}-raw")
        except ValueError:
            raise ConfigError(
                f"env.name: textarena has no game {game_id!r} (see textarena.envs.registration)"
            ) from None
        self.game_id, self.num_players = game_id, num_players
        self.roles = tuple(role(p) for p in range(num_players))

    def _news(self) -> dict[str, str]:
        """What the game told each player since the last call (and forget it: nothing twice)."""
        state = self.env.state
        out = {}
        for pid, messages in state.observations.items():
            text = "".join(
                f"[{state.role_mapping.get(sender, f'Player {sender}')}] {message}\n" for sender, message, _ in messages
            )
            state.observations[pid] = []
            if text:
                out[role(pid)] = text
        return out

    def _turn(self, done: bool) -> Turn:
        news = self._news()
        if not done:
            return Turn(news, role(self.env.state.current_player_id))
        rewards, game_info = self.env.close()
        rewards = {role(p): float(r) for p, r in (rewards or {}).items()}
        meta: dict[str, Any] = {
            "game_info": {role(p): dict(v) for p, v in game_info.items()},
            "success": rewards.get(role(0), 0.0) > 0,
        }
        return Turn(news, None, rewards, meta)

    async def reset(self, row: Example) -> Turn:
        self.env.reset(num_players=self.num_players, seed=int(row.answer))
        return self._turn(done=False)

    async def step(self, role_name: str, action: str) -> Turn:
        if role_name != role(self.env.state.current_player_id):
            raise RuntimeError(f"textarena: {role_name} acted out of turn")
        done, _ = self.env.step(action)
        return self._turn(done)


@functools.cache
def players(game_id: str) -> int:
    """How many players the game takes: 2 unless its state accepts only 1 (textarena asserts the count)."""
    game = TextArenaGame(game_id)  # fails at start for an unknown game, naming env.name
    try:
        game.env.reset(num_players=2, seed=0)
    except AssertionError:
        return 1
    return 2


def factory(name: str):
    game_id = name.removeprefix(PREFIX)
    n = players(game_id)
    return lambda: TextArenaGame(game_id, n)


VALUE = re.compile(r"current value is ([0-9]+\.[0-9]+)")
THRESHOLD = 0.75
"""Secretary-v0: a value above it is worth taking (about 60% wins when always followed)."""
SENSE = 0.5
"""How often the weak Secretary player applies the threshold; otherwise it flips a coin."""


def _secretary(rng: random.Random, news: str) -> str:
    seen = VALUE.findall(news)
    if seen and rng.random() < SENSE:
        return "[accept]" if float(seen[-1]) >= THRESHOLD else "[continue]"
    return rng.choice(["[accept]", "[continue]"])


WEAK_PLAYERS: dict[str, Callable[[random.Random, str], str]] = {
    "Secretary-v0": _secretary,
    "GuessTheNumber-v0": lambda rng, news: f"[{rng.randint(1, 20)}]",
    "Blackjack-v0": lambda rng, news: rng.choice(["[Hit]", "[Stand]"]),
}
"""A weak player per single-player game, (rng, what the game last said) -> move: the player a base
is warmed up on. Secretary's applies the threshold in half of its decisions and otherwise flips a
coin (about 35% wins); the others move at random."""


def demo(game_id: str, row: Example, rng: random.Random, max_turns: int) -> list[tuple[str, bool]]:
    """One episode of the game's weak player as (text, written by the model) pieces: the game's
    messages exactly as an episode's sequence holds them, and the player's moves."""
    move = WEAK_PLAYERS[game_id]
    game = TextArenaGame(game_id, 1)
    game.env.reset(num_players=1, seed=int(row.answer))
    pieces = [(game._news().get(role(0), ""), False)]
    for _ in range(max_turns):
        action = move(rng, pieces[-1][0])
        pieces.append((action, True))
        done, _ = game.env.step(action)
        if news := game._news().get(role(0), ""):
            pieces.append((news, False))
        if done:
            break
    game.env.close()
    return pieces


def rows(game_id: str, count: int, seed: int) -> list[Example]:
    """Rows of a game: its id as the prompt (the ledger's key), a seed as the answer."""
    rng = random.Random(seed)
    return [Example(i, game_id, str(rng.randrange(2**31))) for i in range(count)]
