"""What the server records of an agent's episode, and how a request names one.

`AgentEpisode` is one episode as serve/recorder.py's `EpisodeRecorder` keeps it: its token trace
(nonstop/token_trace.py) and the transcript a later request must extend. `AgentGroup` is the
episodes of one group id with its timeout, and `Turn` a request admitted into an episode.
`episode_tag` reads a request's episode and group ids (headers `X-Episode-Id` / `X-Group-Id`,
else the body's `episode_id` / `group_id`, which it removes from the body); `check_id` refuses
an id that is empty, too long or not printable.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from nonstop.serve.validation import BadRequest
from nonstop.token_trace import TokenTrace

EPISODE_HEADER, GROUP_HEADER = "X-Episode-Id", "X-Group-Id"
MAX_ID_CHARS = 200


@dataclass
class AgentEpisode(TokenTrace):
    episode_id: str = ""
    group_id: str = ""
    by_text: bool = False  # the transcript is compared as text (else as token ids)
    transcript: str = ""
    reward: float | None = None
    busy: bool = False

    def state(self) -> str:
        return "rewarded" if self.reward is not None else ("generating" if self.busy else "open")


@dataclass
class AgentGroup:
    group_id: str
    episodes: list[str] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


@dataclass(frozen=True)
class Turn:
    """A turn admitted by `begin_turn`: the ids to generate from and what it appends on `end_turn`."""

    episode_id: str
    prefix: list[int]
    env_ids: list[int]
    transcript: str


def check_id(value: str, what: str) -> None:
    if not value or len(value) > MAX_ID_CHARS or not value.isprintable():
        raise BadRequest(f"{what}: expected 1 to {MAX_ID_CHARS} printable characters", what)


def episode_tag(headers: Any, body: Any) -> tuple[str | None, str | None]:
    """(episode id, group id) of a request: headers first, else the body's `episode_id` / `group_id`
    (the openai client's extra_body), which are removed from the body."""
    eid, gid = headers.get(EPISODE_HEADER), headers.get(GROUP_HEADER)
    if isinstance(body, dict):
        b_eid, b_gid = body.pop("episode_id", None), body.pop("group_id", None)
        for name, v in (("episode_id", b_eid), ("group_id", b_gid)):
            if v is not None and not isinstance(v, str):
                raise BadRequest(f"{name}: expected a string", name)
        eid = eid if eid is not None else b_eid
        gid = gid if gid is not None else b_gid
    return eid, gid
