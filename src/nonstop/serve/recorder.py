"""Episodes of agents over the API, recorded server-side token by token (docs/api_agents.md).

An agent passes an episode id (header `X-Episode-Id`, or body field `episode_id`) and a group id
(`X-Group-Id` / `group_id`) with each request of an episode. `EpisodeRecorder` keeps, per
episode, one token sequence as `orchestrator/episodes.py` keeps a role's: the first request's
prompt ids, then each turn's sampled ids (behaviour logprobs, policy versions, loss mask True)
and, between turns, the ids of the text the agent added (its environment's text: loss mask
False, logprob 0, version -1). Nothing is re-encoded: a later request's prompt (text, or token
ids) must extend the transcript recorded so far (the earlier prompt plus the completion text the
server returned), and only the new suffix is encoded, without special tokens: the bridge tokens
of docs/environments.md. A request whose history differs from the record is refused (400 naming
the episode and where it differs); so is one sent while a turn of the same episode is in flight.

`reward(id, r)` rewards an episode once (a second post: 409; an unknown id: 404). When all
`group_size` episodes of a group are rewarded, the group (one `Sample` per episode) goes to
`ready` for the trainer, and the episodes leave memory. A group with no request and no reward in
any of its episodes for `episode_timeout_s` is dropped whole: its unrewarded episodes count as
abandoned (a client that was killed mid-episode ends this way), nothing of it trains, and its
memory is freed. At most `max_open_episodes` episodes are held (open, or rewarded and waiting
for the trainer); a request that would start another is refused with 429. Ids that finished
are remembered (a bounded number) so a late request or reward gets a clear 409 or 410 instead
of starting a new episode.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nonstop.serve.episode_record import EPISODE_HEADER, GROUP_HEADER, AgentEpisode, AgentGroup, Turn, check_id
from nonstop.serve.validation import BadRequest
from nonstop.types import Group, Sample

REMEMBERED = 4096
"""Finished episode ids remembered for clear answers to late requests (the oldest are forgotten)."""


class EpisodeRecorder:
    def __init__(
        self,
        tokenizer: Any,
        group_size: int,
        episode_timeout_s: float,
        max_open_episodes: int,
        log_path: Path | None = None,
        on_drop: Callable[[str], None] | None = None,
    ) -> None:
        if max_open_episodes < group_size:
            raise ValueError(f"max_open_episodes ({max_open_episodes}) < group_size ({group_size})")
        self.tokenizer, self.group_size = tokenizer, group_size
        self.episode_timeout_s, self.max_open_episodes = episode_timeout_s, max_open_episodes
        self.log_path, self.on_drop = log_path, on_drop
        self.episodes: dict[str, AgentEpisode] = {}
        self.groups: dict[str, AgentGroup] = {}
        self.finished: OrderedDict[str, str] = OrderedDict()  # episode id -> how it ended
        self.finished_groups: OrderedDict[str, None] = OrderedDict()
        # holds at most max_open_episodes // group_size groups: they count against the cap until taken
        self.ready: asyncio.Queue[Group] = asyncio.Queue(maxsize=max_open_episodes // group_size + 1)
        self.counts: Counter[str] = Counter()
        self.closed: str | None = None  # why recorded requests are refused now (the run stopped training)
        self._index = 0

    # -- requests -------------------------------------------------------------------------------

    def begin_turn(
        self,
        episode_id: str,
        group_id: str | None,
        *,
        text: str | None = None,
        ids: list[int] | None = None,
        first_ids: Callable[[], list[int]] | None = None,
        param: str = "prompt",
    ) -> Turn:
        """Admit a request of an episode: the full prefix to generate from. A new id starts an episode
        whose prompt ids are `first_ids()` (the server's own encoding of the request); `text` (a text
        prompt, a rendered chat) or `ids` (a token prompt) must extend what was recorded."""
        check_id(episode_id, EPISODE_HEADER)
        if self.closed is not None:
            raise BadRequest(f"episode {episode_id}: {self.closed}", "episode_id", 409)
        ep = self.episodes.get(episode_id)
        if ep is None:
            return self._start(episode_id, group_id, text, ids, first_ids)
        if group_id is not None and group_id != ep.group_id:
            raise BadRequest(
                f"episode {episode_id} belongs to group {ep.group_id!r}, not {group_id!r}", "group_id", 400
            )
        if ep.reward is not None:
            self.counts["refused_after_reward"] += 1
            raise BadRequest(f"episode {episode_id} was already rewarded: it takes no more turns", "episode_id", 409)
        if ep.busy:
            raise BadRequest(f"episode {episode_id}: a turn is already in flight; send turns one at a time", None, 409)
        if (text is not None) != ep.by_text:
            raise BadRequest(
                f"episode {episode_id}: started with a {'text' if ep.by_text else 'token-id'} prompt; "
                "keep one kind of prompt for the whole episode",
                param,
            )
        if text is not None:
            if not text.startswith(ep.transcript):
                self.counts["diverged"] += 1
                at = next((i for i, (a, b) in enumerate(zip(text, ep.transcript)) if a != b), len(text))
                raise BadRequest(
                    f"episode {episode_id}: this prompt does not extend the episode's recorded transcript "
                    f"(it differs at character {at} of {len(ep.transcript)}); send the conversation so far "
                    "unchanged, completions as the server returned them, plus the new text",
                    param,
                )
            suffix = text[len(ep.transcript) :]
            env_ids = list(self.tokenizer(suffix, add_special_tokens=False)["input_ids"]) if suffix else []
            transcript = text
        else:
            assert ids is not None
            have = ep.prefix()
            if ids[: len(have)] != have:
                self.counts["diverged"] += 1
                at = next((i for i, (a, b) in enumerate(zip(ids, have)) if a != b), len(ids))
                raise BadRequest(
                    f"episode {episode_id}: these token ids do not extend the episode's recorded tokens "
                    f"(they differ at position {at} of {len(have)}); send the tokens so far unchanged plus new ones",
                    param,
                )
            env_ids, transcript = list(ids[len(have) :]), ""
        ep.busy = True
        self._touch(ep.group_id)
        return Turn(episode_id, ep.prefix() + env_ids, env_ids, transcript)

    def _start(
        self,
        episode_id: str,
        group_id: str | None,
        text: str | None,
        ids: list[int] | None,
        first_ids: Callable[[], list[int]] | None,
    ) -> Turn:
        if episode_id in self.finished:
            raise BadRequest(f"episode {episode_id} {self.finished[episode_id]}; start a new episode id", None, 410)
        if group_id is None:
            raise BadRequest(
                f"episode {episode_id}: a recorded episode needs a group id ({GROUP_HEADER} header or group_id field)",
                "group_id",
            )
        check_id(group_id, GROUP_HEADER)
        group = self.groups.get(group_id)
        if group is not None and len(group.episodes) >= self.group_size:
            raise BadRequest(
                f"group {group_id} already has its {self.group_size} episodes (rollout.group_size); use a new group id",
                "group_id",
                409,
            )
        if group is None and group_id in self.finished_groups:
            raise BadRequest(f"group {group_id} has finished; use a new group id", "group_id", 409)
        if self.held() >= self.max_open_episodes:
            self.counts["refused_full"] += 1
            raise BadRequest(
                f"episode {episode_id}: {self.max_open_episodes} episodes are open (agents.max_open_episodes); "
                "finish (reward) open episodes first, or retry later",
                None,
                429,
            )
        prompt = list(first_ids() if first_ids is not None else ids or [])
        if group is None:
            group = self.groups[group_id] = AgentGroup(group_id)
        group.episodes.append(episode_id)
        ep = self.episodes[episode_id] = AgentEpisode(
            prompt_ids=prompt, episode_id=episode_id, group_id=group_id, by_text=text is not None, transcript=text or ""
        )
        ep.busy = True
        self.counts["episodes_started"] += 1
        self._touch(group_id)
        return Turn(episode_id, list(prompt), [], ep.transcript)

    def end_turn(self, turn: Turn, sample: Sample, text: str) -> None:
        """The turn's completion (`text`: as the client got it): the environment's ids, then the model's."""
        ep = self.episodes.get(turn.episode_id)
        if ep is None:  # dropped while generating (its group timed out): nothing to record
            return
        ep.busy = False
        ep.append_env(turn.env_ids)
        ep.append_model(sample)
        ep.transcript = turn.transcript + text
        self.counts["turns_recorded"] += 1
        self._touch(ep.group_id)

    def abort_turn(self, turn: Turn) -> None:
        """The turn failed or its client hung up: nothing of it is recorded."""
        ep = self.episodes.get(turn.episode_id)
        if ep is not None:
            ep.busy = False

    # -- rewards ---------------------------------------------------------------------------------

    def reward(self, episode_id: str, reward: float) -> dict[str, Any]:
        check_id(episode_id, EPISODE_HEADER)
        ep = self.episodes.get(episode_id)
        if ep is None:
            if episode_id in self.finished:
                how = self.finished[episode_id]
                self.counts["late_rewards" if how.startswith("was dropped") else "duplicate_rewards"] += 1
                raise BadRequest(f"episode {episode_id} {how}", None, 409)
            self.counts["unknown_episodes"] += 1
            raise BadRequest(f"episode {episode_id} not found (no request of it was recorded)", None, 404)
        if ep.reward is not None:
            self.counts["duplicate_rewards"] += 1
            raise BadRequest(f"episode {episode_id} was already rewarded ({ep.reward}); rewards are final", None, 409)
        if ep.busy:
            raise BadRequest(f"episode {episode_id}: a turn is in flight; reward it once its turns are done", None, 409)
        if ep.turns == 0:
            raise BadRequest(f"episode {episode_id} has no finished turn to reward", None, 409)
        ep.reward = float(reward)
        self.counts["episodes_rewarded"] += 1
        group = self.groups[ep.group_id]
        done = len(group.episodes) == self.group_size and all(
            self.episodes[e].reward is not None for e in group.episodes
        )
        if done:
            self._deliver(group)
        else:
            self._touch(group.group_id)
        return {"episode_id": episode_id, "group_id": ep.group_id, "reward": ep.reward, "group_complete": done}

    def describe(self, episode_id: str) -> dict[str, Any]:
        check_id(episode_id, EPISODE_HEADER)
        ep = self.episodes.get(episode_id)
        if ep is None:
            if episode_id in self.finished:
                return {"episode_id": episode_id, "state": self.finished[episode_id]}
            self.counts["unknown_episodes"] += 1
            raise BadRequest(f"episode {episode_id} not found", None, 404)
        return {
            "episode_id": episode_id,
            "group_id": ep.group_id,
            "state": ep.state(),
            "turns": ep.turns,
            "prompt_tokens": len(ep.prompt_ids),
            "completion_tokens": len(ep.ids),
            "model_tokens": sum(ep.mask),
            "policy_versions": sorted({v for v in ep.versions if v >= 0}),
            "reward": ep.reward,
        }

    # -- the trainer's side -------------------------------------------------------------------------

    async def next_group(self) -> Group:
        """The next complete, rewarded group (one Sample per episode, `episode` its index in the group)."""
        return await self.ready.get()

    def held(self) -> int:
        """Episodes in memory: open or rewarded, and those of groups waiting for the trainer."""
        return len(self.episodes) + self.ready.qsize() * self.group_size

    def close(self, why: str) -> None:
        """Refuse recorded requests from now on (`why` is the refusal); drop what is open, counted."""
        self.closed = why
        for gid in list(self.groups):
            self._drop(gid, "run_ended")

    def report(self) -> dict[str, Any]:
        return {
            **{k: self.counts[k] for k in ("episodes_started", "episodes_rewarded", "groups_delivered")},
            "episodes_abandoned": self.counts["episodes_abandoned"],
            "episodes_dropped_at_run_end": self.counts["episodes_dropped_at_run_end"],
            "groups_dropped": self.counts["groups_dropped"],
            "open_episodes": len(self.episodes),
            "refused": {
                k: self.counts[k]
                for k in (
                    "refused_full",
                    "duplicate_rewards",
                    "late_rewards",
                    "unknown_episodes",
                    "diverged",
                    "refused_after_reward",
                )
                if self.counts[k]
            },
        }

    # -- internals ---------------------------------------------------------------------------------

    def _touch(self, group_id: str) -> None:
        """Any activity in a group restarts its timeout."""
        group = self.groups[group_id]
        if group.timer is not None:
            group.timer.cancel()
        loop = asyncio.get_running_loop()
        group.timer = loop.call_later(self.episode_timeout_s, self._expire, group_id)

    def _expire(self, group_id: str) -> None:
        self._drop(group_id, "abandoned")

    def _forget(self, episode_id: str, how: str) -> None:
        self.finished[episode_id] = how
        while len(self.finished) > REMEMBERED:
            self.finished.popitem(last=False)

    def _forget_group(self, group_id: str) -> None:
        self.finished_groups[group_id] = None
        while len(self.finished_groups) > REMEMBERED:
            self.finished_groups.popitem(last=False)

    def _drop(self, group_id: str, reason: str) -> None:
        group = self.groups.pop(group_id, None)
        if group is None:
            return
        if group.timer is not None:
            group.timer.cancel()
        self._forget_group(group_id)
        unrewarded = 0
        for eid in group.episodes:
            ep = self.episodes.pop(eid)
            unrewarded += ep.reward is None
            self._forget(eid, f"was dropped ({reason}: its group {group_id} was not complete)")
        if reason == "abandoned":
            self.counts["episodes_abandoned"] += unrewarded
        else:  # training ended with the group still open: not the agent's fault
            self.counts["episodes_dropped_at_run_end"] += len(group.episodes)
        self.counts["groups_dropped"] += 1
        if self.on_drop is not None and reason == "abandoned":
            self.on_drop(
                f"agents: group {group_id} dropped: {unrewarded} of its {len(group.episodes)} episode(s) got no "
                f"reward and the group saw no request for {self.episode_timeout_s:g} s (agents.episode_timeout_s)"
            )

    def _deliver(self, group: AgentGroup) -> None:
        if group.timer is not None:
            group.timer.cancel()
        del self.groups[group.group_id]
        self._forget_group(group.group_id)
        samples = []
        for i, eid in enumerate(group.episodes):
            ep = self.episodes.pop(eid)
            self._forget(eid, f"was rewarded; its group {group.group_id} went to training")
            text = self.tokenizer.decode(ep.ids, skip_special_tokens=True)
            samples.append(ep.sample(reward=float(ep.reward or 0.0), text=text, episode=i))
        out = Group(self._index, group.group_id, "", samples, extra={"episode_ids": list(group.episodes)})
        self._index += 1
        self.counts["groups_delivered"] += 1
        if self.log_path is not None:
            self._log(out)
        self.ready.put_nowait(out)  # bounded by max_open_episodes: never full

    def _log(self, g: Group) -> None:
        """One JSON line per group handed to training: the tokens as recorded, for audits and tests."""
        line = {
            "index": g.prompt_index,
            "group_id": g.prompt,
            "time": round(time.time(), 3),
            "episodes": [
                {
                    "episode_id": eid,
                    "reward": s.reward,
                    "prompt_ids": s.prompt_ids,
                    "completion_ids": s.completion_ids,
                    "loss_mask": [int(m) for m in s.loss_mask],
                    "versions": s.versions,
                    "crc32": zlib.crc32(",".join(map(str, s.completion_ids)).encode()),
                }
                for eid, s in zip(g.extra["episode_ids"], g.samples)
            ],
        }
        assert self.log_path is not None
        with self.log_path.open("a") as f:
            f.write(json.dumps(line) + "\n")
