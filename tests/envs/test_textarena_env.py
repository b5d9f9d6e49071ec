"""textarena games as multi-agent environments, with the real textarena engine: scripted games
check who hears what and the zero-sum rewards; a tiny model plays both seats through the
episode runner. Skipped without the extra."""

from __future__ import annotations

import asyncio

import pytest

ta = pytest.importorskip("textarena")

from nonstop.config import ConfigError, TinyModelConfig, load_config  # noqa: E402
from nonstop.engine.aio import AsyncEngine  # noqa: E402
from nonstop.engine.core import TorchEngine  # noqa: E402
from nonstop.envs.base import EnvLimits  # noqa: E402
from nonstop.envs.registry import builtin_task, env_factory  # noqa: E402
from nonstop.envs.textarena_env import TextArenaGame  # noqa: E402
from nonstop.hf import load_model, load_tokenizer  # noqa: E402
from nonstop.models.tiny import save_tiny  # noqa: E402
from nonstop.orchestrator.modes.environment.episode_flow import EnvRun  # noqa: E402
from nonstop.orchestrator.modes.environment.episodes import RoleEngines, encode_observation, run_episodes  # noqa: E402
from nonstop.orchestrator.modes.own_policies.policy_build import check_roles  # noqa: E402
from nonstop.tasks.codec import Codec  # noqa: E402
from nonstop.tasks.data import Example  # noqa: E402
from nonstop.types import SamplingParams  # noqa: E402


def _play(moves: list[str]):
    game = TextArenaGame("Nim-v0")

    async def go():
        turns = [await game.reset(Example(0, "Nim-v0", "7"))]
        for move in moves:
            turns.append(await game.step(turns[-1].next_role, move))
        return turns

    return asyncio.run(go())


def test_a_scripted_nim_game_routes_each_message_to_its_players_and_ends_zero_sum():
    # piles [3, 4, 5]: player 0 empties pile 2, player 1 fumbles once, then the piles run out
    turns = _play(["[2 5]", "take some", "[1 4]", "[0 3]"])
    first = turns[0]
    assert first.next_role == "player_0" and set(first.observations) == {"player_0", "player_1"}
    assert all(
        "Welcome to Nim" in first.observations[r] and "pile 2: 5" in first.observations[r] for r in first.observations
    )
    after0 = turns[1]
    assert after0.next_role == "player_1"
    assert "[Player 0] [2 5]" in after0.observations["player_1"] and "pile 2: 0" in after0.observations["player_1"]
    invalid = turns[2]  # the fumbling player alone hears why, and moves again
    assert invalid.next_role == "player_1" and "invalid move" in invalid.observations["player_1"]
    assert (
        "[Player 1] take some" in invalid.observations["player_0"] and "invalid" not in invalid.observations["player_0"]
    )
    last = turns[-1]
    assert last.done and last.rewards == {"player_0": 1.0, "player_1": -1.0}
    assert last.metadata["success"] and "took the last" in last.metadata["game_info"]["player_0"]["reason"]
    # nothing is heard twice: each observation is new text only
    heard = "".join(t.observations.get("player_1", "") for t in turns)
    assert heard.count("Welcome to Nim") == 1 and heard.count("[Player 0] [2 5]") == 1


class Heard(TextArenaGame):
    """The real game, keeping what it told each role (the test's independent record)."""

    made: list[Heard] = []

    def __init__(self) -> None:
        super().__init__("Nim-v0")
        self.heard: dict[str, list[str]] = {r: [] for r in self.roles}
        Heard.made.append(self)

    def _keep(self, turn):
        for r, text in turn.observations.items():
            self.heard[r].append(text)
        return turn

    async def reset(self, row):
        return self._keep(await super().reset(row))

    async def step(self, role_name, action):
        return self._keep(await super().step(role_name, action))


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """A tiny model with positions for textarena's long prompts."""
    return save_tiny(
        tmp_path_factory.mktemp("tiny"),
        TinyModelConfig(
            hidden_size=32,
            num_layers=1,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            max_position_embeddings=1024,
        ),
    )


def test_a_tiny_model_plays_both_seats_token_exact_per_role(long_tiny):
    """Each seat's sequence is its prompt, then its model turns and exactly the game's news to it."""
    folder = long_tiny
    tok = load_tokenizer(str(folder))
    codec = Codec(tok)
    engine = AsyncEngine(TorchEngine(load_model(str(folder)), [tok.eos_token_id], tok.pad_token_id))
    cfg = load_config(None, ["env.name=textarena/Nim-v0", "env.train_rows=8", "env.eval_rows=4"]).env
    data = builtin_task(cfg)
    assert [r.prompt for r in data.train] == ["Nim-v0"] * 8 and len({r.answer for r in data.train}) == 8
    assert EnvRun.build(cfg).baselines.mode == "ema"  # two seats of a zero-sum game
    Heard.made = []
    done, errors = asyncio.run(
        run_episodes(engine, Heard, data.train[:4], codec, EnvLimits(4, 900, 6, 10.0), SamplingParams(6, 1.0))
    )
    assert not errors and len(done) == 4
    for e, game in zip(done, Heard.made):
        assert [s.role for s in e.samples] == ["player_0", "player_1"]
        assert e.truncated or sorted(s.reward for s in e.samples) == [-1.0, 1.0]
        for s in e.samples:
            news = game.heard[s.role]
            assert s.prompt_ids == codec.encode(news[0]) and "Welcome to Nim" in news[0]
            appended = [t for t, m in zip(s.completion_ids, s.loss_mask) if not m]
            assert appended == [t for text in news[1:] for t in encode_observation(codec, text)]
        assert sum(e.samples[0].loss_mask) > 0  # the first seat always moves (the second may lose before it does)
    with pytest.raises(ConfigError, match="no game 'Chezz-v0'"):
        env_factory("textarena/Chezz-v0")


class Counting:
    """A real in-process engine that keeps the prompt of every request it served."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine, self.prompts = engine, []

    async def generate(self, requests):
        self.prompts += [r.prompt_ids for r in requests]
        return await self.engine.generate(requests)


class Legal(Heard):
    """Nim where every turn plays the first legal move (one object from the first pile left),
    whatever the model wrote, so both seats move in every game (a random model's moves are
    invalid, and two invalid moves end a game before the second seat moves)."""

    async def step(self, role_name, action):
        piles = self.env.state.game_state["piles"]
        return await super().step(role_name, f"[{next(k for k, n in enumerate(piles) if n)} 1]")


def test_a_seat_with_its_own_policy_plays_on_its_own_engines(long_tiny):
    """env.policies.player_0 on a textarena game: the config is taken and the seats are the roles
    checked; player_0's turns go only to its own policy's engine (their prompts start with its
    seat's first news), player_1's only to the shared one, and each sample names its policy."""
    cfg = load_config(None, ["env.name=textarena/Nim-v0", "env.policies.player_0.lr=0.001"])
    assert cfg.env is not None
    check_roles(cfg, tuple(env_factory(cfg.env.name, "env.name", cfg.env)().roles))
    tok = load_tokenizer(str(long_tiny))
    codec = Codec(tok)

    def engine() -> Counting:
        return Counting(AsyncEngine(TorchEngine(load_model(str(long_tiny)), [tok.eos_token_id], tok.pad_token_id)))

    shared, own = engine(), engine()
    Heard.made = []
    rows = [Example(i, "Nim-v0", str(i)) for i in range(4)]
    engines = RoleEngines(shared, {"player_0": own})
    done, errors = asyncio.run(
        run_episodes(engines, Legal, rows, codec, EnvLimits(4, 900, 6, 10.0), SamplingParams(6, 1.0))
    )
    assert not errors and len(done) == 4
    firsts = {r: {tuple(codec.encode(g.heard[r][0])) for g in Heard.made} for r in ("player_0", "player_1")}
    assert own.prompts and all(any(tuple(p[: len(f)]) == f for f in firsts["player_0"]) for p in own.prompts)
    assert all(any(tuple(p[: len(f)]) == f for f in firsts["player_1"]) for p in shared.prompts)

    def turns(seat: int) -> int:  # a seat's model turns in all games: the runs of loss-mask 1 in its sample
        masks = [e.samples[seat].loss_mask for e in done]
        return sum(m[t] and (t == 0 or not m[t - 1]) for m in masks for t in range(len(m)))

    assert len(own.prompts) == turns(0) >= 4 and len(shared.prompts) == turns(1) >= 4  # both seats moved
    for e in done:
        assert [(s.role, s.policy) for s in e.samples] == [("player_0", "player_0"), ("player_1", "")]


class Replaying:
    """The policy of a scripted game, on the engine seam: it writes the given moves in order."""

    def __init__(self, tok, moves: list[str]) -> None:
        self.tok, self.moves = tok, list(moves)

    async def generate(self, requests):
        from nonstop.types import Sample

        out = []
        for r in requests:
            ids = self.tok(self.moves.pop(0), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append([Sample(list(r.prompt_ids), ids, [0.0] * len(ids), [0] * len(ids), "stop")])
        return out


def test_a_single_player_game_is_one_role_and_its_warmup_player_writes_what_episodes_hold(long_tiny):
    """GuessTheNumber takes one player (textarena asserts it; the adapter probes it); the warm-up's
    random guesser plays the real game, and its transcript, piece by piece, is the token sequence
    the episode runner makes when the same moves are played."""
    import random

    from nonstop.envs import textarena_env
    from nonstop.envs.registry import demo_of

    assert textarena_env.players("GuessTheNumber-v0") == 1 and textarena_env.players("Nim-v0") == 2
    cfg = load_config(None, ["env.name=textarena/GuessTheNumber-v0", "env.max_turns=6", "env.train_rows=8"]).env
    assert env_factory(cfg.name, cfg=cfg)().roles == ("player_0",)
    assert EnvRun.build(cfg).baselines.mode == "group"
    assert demo_of(load_config(None, ["env.name=textarena/Nim-v0"]).env) is None  # two players: no warm-up player
    tok = load_tokenizer(str(long_tiny))
    codec = Codec(tok)
    rows = builtin_task(cfg).train
    outcomes = set()
    for seed in range(40):  # until both a found number and a game cut at max_turns were checked
        row = rows[seed % len(rows)]
        pieces = demo_of(cfg)(row, random.Random(seed), cfg.max_turns)
        moves = [text for text, by_model in pieces if by_model]
        assert 1 <= len(moves) <= 6 and all(m.startswith("[") and m.endswith("]") for m in moves)
        assert "Guess The Number" in pieces[0][0] and not pieces[0][1]
        demo_ids = [
            t
            for text, by_model in pieces
            for t in tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if by_model else [])
        ]
        done, errors = asyncio.run(
            run_episodes(
                Replaying(tok, moves),
                env_factory(cfg.name, cfg=cfg),
                [row],
                codec,
                EnvLimits(6, 1000, 5, 10.0),
                SamplingParams(5, 1.0),
            )
        )
        (s,) = done[0].samples
        assert not errors and s.prompt_ids + s.completion_ids == demo_ids
        assert done[0].turns == len(moves) and done[0].success == (s.reward > 0) == (not done[0].truncated)
        outcomes.add(done[0].success)
        if outcomes == {True, False}:
            break
    assert outcomes == {True, False}
    # Secretary's weak player reads the value it was shown in half of its decisions
    accepts = {
        v: sum(textarena_env._secretary(rng, f"[GAME] The current value is {v}.\n") == "[accept]" for _ in range(400))
        for v, rng in (("0.9000", random.Random(1)), ("0.1000", random.Random(2)))
    }
    assert accepts["0.9000"] > 250 and accepts["0.1000"] < 150


def test_warmup_windows_keep_each_move_with_the_context_before_it():
    """A textarena warm-up trains on windows: each run of player tokens with `width` tokens of context
    before it, the context unlabelled; nothing of a later move leaks into an earlier window."""
    from nonstop.models.env_warmup import windows

    ids = list(range(10))
    labels = [-100, -100, -100, 3, 4, -100, -100, -100, 8, 9]
    assert windows([(ids, labels)], 2) == [
        ([1, 2, 3, 4], [-100, -100, 3, 4]),
        ([6, 7, 8, 9], [-100, -100, 8, 9]),
    ]
    assert windows([(ids, labels)], 5)[0] == ([0, 1, 2, 3, 4], [-100, -100, -100, 3, 4])  # cut at the start
    assert windows([([1, 2], [-100, -100])], 3) == []
