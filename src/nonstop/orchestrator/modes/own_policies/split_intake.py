"""The producer's intake when an episode's roles play separate policies (env.policies).

One row's episodes feed several buffers: the shared policy's and each own policy's. Admission is
joint (a row is generated only when every buffer admits it, and what a later buffer refuses is
given back to the earlier ones), and a finished group is split by the policy that wrote each
sample, each part settled in its own buffer: put, or dropped by reason ('no_model_tokens' when a
policy's roles wrote nothing, 'uniform_reward' under rollout.filter_uniform_reward). Invariant:
every admitted row is settled once per policy, also across a resume (the ledger's settled parts).
"""

from __future__ import annotations

from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.modes.environment.episode_flow import EPS
from nonstop.types import Group


class SplitIntake:
    """The producer's buffer when roles play separate policies: joint admission, one part per policy."""

    def __init__(self, buffers: dict[str, RolloutBuffer], filter_uniform: bool, ledger: Ledger | None = None) -> None:
        self.buffers, self.filter_uniform, self.ledger = buffers, filter_uniform, ledger

    async def admit(self, max_groups: int) -> int:
        """Rows every policy's buffer admits: each buffer admits up to the count the ones before it gave,
        and what a later one refuses is given back to the earlier ones."""
        held: list[RolloutBuffer] = []
        k = max_groups
        for buf in self.buffers.values():
            got = await buf.admit(k)
            if got < k:
                for h in held:
                    await h.refund(k - got)
            k = got
            held.append(buf)
        return k

    async def refund(self, n: int) -> None:
        for buf in self.buffers.values():
            await buf.refund(n)

    async def close(self) -> None:
        for buf in self.buffers.values():
            await buf.close()

    async def parts(self, group: Group) -> dict[str, Group]:
        """The group split by the policy that wrote each sample (an empty part for a policy with none).
        A policy that settled its part of this row before a resume gets none: its admission is refunded."""
        done = self.ledger.settled_parts(group.epoch, group.prompt_index) if self.ledger is not None else {}
        split: dict[str, list] = {p: [] for p in self.buffers if p not in done}
        for p in done:
            await self.buffers[p].refund(1)
        for s in group.samples:
            if s.policy in split:
                split[s.policy].append(s)
        return {
            p: Group(group.prompt_index, group.prompt, group.answer, samples, epoch=group.epoch)
            for p, samples in split.items()
        }

    async def put(self, group: Group) -> None:
        for p, part in (await self.parts(group)).items():
            if not part.samples:  # this policy's roles wrote no token in any episode of the row
                await self.buffers[p].drop(part, "no_model_tokens")
            elif self.filter_uniform and not any(abs(s.advantage or 0.0) > EPS for s in part.samples):
                await self.buffers[p].drop(part, "uniform_reward")
            else:
                await self.buffers[p].put(part)

    async def drop(self, group: Group, reason: str) -> None:
        for p, part in (await self.parts(group)).items():
            await self.buffers[p].drop(part, reason)
