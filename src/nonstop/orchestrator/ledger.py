"""The prompt ledger: what happened to every prompt drawn from the stream.

Invariant: each (epoch, prompt index) is drawn once and settled once. A draw is in flight until
it is settled with an outcome: `trained`, or the reason it was dropped (`uniform_reward`,
`reward_error`, `max_lag`, `skipped_step`; in environment runs also `env_error`,
`no_model_tokens`). Episodes removed from a group that still trains (buffer.reject 'episode')
are counted in `episodes_dropped`. Prompts held by a crashed engine stay in flight
and are generated again; prompts in flight at a checkpoint are re-queued on resume. A second
draw or a second settlement of the same prompt is counted as a duplicate, never hidden, and a
settlement of a prompt that was never drawn is counted as unknown; the fault tests assert both
stay at zero. The state is plain JSON and travels in checkpoints.

With separate policies per role (env.policies) a row's group is split into one part per policy,
each trained (or dropped) by its own policy's buffer and learner loop, which settle their part
through `part(name)`: the row settles once every policy settled its part, as the part outcome
when they agree and as 'policy:outcome+policy:outcome' (the shared policy first, then by role)
when they differ; `parts` counts
the part outcomes by 'policy:outcome' (the shared policy is named 'shared').
"""

from __future__ import annotations

from collections import Counter
from typing import Protocol

from nonstop.tasks.data import Draw

Key = tuple[int, int]  # (epoch, prompt index)


class Settler(Protocol):
    """What a buffer and a learner loop settle through: the ledger, or one policy's part of it."""

    def settle(self, epoch: int, index: int, outcome: str) -> None: ...

    def drop_episodes(self, n: int, reason: str) -> None: ...


SHARED = ""  # the policy name of the run's shared policy


def policy_label(policy: str) -> str:
    """How reports name a policy: its role, or 'shared' for the run's shared policy ('')."""
    return policy or "shared"


class Ledger:
    def __init__(self, parts: tuple[str, ...] = ()) -> None:
        self.part_names = parts  # the policies a row is split between (env.policies); () : not split
        self.partial: dict[Key, dict[str, str]] = {}  # rows some, not all, policies settled their part of
        self.part_outcomes: Counter[str] = Counter()
        self.in_flight: dict[Key, Draw] = {}  # insertion order is draw order
        self.outcomes: dict[Key, str] = {}
        self.duplicated_draws = 0
        self.duplicated_settlements = 0
        self.unknown_settlements = 0
        self.requeued = 0
        self.episodes_dropped: Counter[str] = Counter()  # episodes removed from groups that still trained

    def drop_episodes(self, n: int, reason: str) -> None:
        """Some episodes of a group were dropped (buffer.reject 'episode'); the group settles as usual."""
        self.episodes_dropped[reason] += n

    def draw(self, draw: Draw) -> None:
        key = (draw.epoch, draw.example.index)
        if key in self.in_flight or key in self.outcomes:
            self.duplicated_draws += 1
        self.in_flight[key] = draw

    def settle(self, epoch: int, index: int, outcome: str) -> None:
        key = (epoch, index)
        if key in self.outcomes:
            self.duplicated_settlements += 1
            return
        if self.in_flight.pop(key, None) is None:
            self.unknown_settlements += 1
            return
        self.outcomes[key] = outcome

    def part(self, policy: str) -> PartLedger:
        """The view through which `policy` settles its part of each row."""
        assert policy in self.part_names, (policy, self.part_names)
        return PartLedger(self, policy)

    def settle_part(self, policy: str, epoch: int, index: int, outcome: str) -> None:
        key = (epoch, index)
        if key in self.outcomes:
            self.duplicated_settlements += 1
            return
        if key not in self.in_flight:
            self.unknown_settlements += 1
            return
        got = self.partial.setdefault(key, {})
        if policy in got:
            self.duplicated_settlements += 1
            return
        got[policy] = outcome
        self.part_outcomes[f"{policy_label(policy)}:{outcome}"] += 1
        if len(got) == len(self.part_names):
            del self.partial[key]
            kinds = set(got.values())
            self.settle(
                epoch,
                index,
                kinds.pop() if len(kinds) == 1 else "+".join(f"{policy_label(p)}:{o}" for p, o in sorted(got.items())),
            )

    def pending(self) -> list[Draw]:
        """Drawn but not settled, in draw order: what a resume must generate again."""
        return list(self.in_flight.values())

    def release_pending(self) -> list[Draw]:
        """Forget the in-flight draws (they go back to the stream) and return them."""
        draws = self.pending()
        self.in_flight.clear()
        self.requeued += len(draws)
        return draws

    def epoch_settled(self, epoch: int) -> list[int]:
        return sorted(i for (e, i) in self.outcomes if e == epoch)

    def report(self) -> dict:
        return {
            "settled": len(self.outcomes),
            "in_flight": len(self.in_flight),
            "outcomes": dict(Counter(self.outcomes.values())),
            "duplicated": self.duplicated_draws + self.duplicated_settlements,
            "unknown": self.unknown_settlements,
            "requeued": self.requeued,
            "episodes_dropped": dict(self.episodes_dropped),
            **({"parts": dict(self.part_outcomes)} if self.part_names else {}),
        }

    def state_dict(self) -> dict:
        return {
            "outcomes": [[e, i, o] for (e, i), o in self.outcomes.items()],
            "in_flight": [[d.epoch, d.example.index] for d in self.in_flight.values()],
            "duplicated_draws": self.duplicated_draws,
            "duplicated_settlements": self.duplicated_settlements,
            "unknown_settlements": self.unknown_settlements,
            "requeued": self.requeued,
            "episodes_dropped": dict(self.episodes_dropped),
            "partial": [[e, i, got] for (e, i), got in self.partial.items()],
            "part_outcomes": dict(self.part_outcomes),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore settlements and counters. In-flight draws are not restored: the caller re-queues them."""
        self.outcomes = {(int(e), int(i)): o for e, i, o in state["outcomes"]}
        self.in_flight = {}
        self.duplicated_draws = state["duplicated_draws"]
        self.duplicated_settlements = state["duplicated_settlements"]
        self.unknown_settlements = state["unknown_settlements"]
        self.requeued = state["requeued"]
        self.episodes_dropped = Counter(state.get("episodes_dropped", {}))  # absent in checkpoints of older runs
        # Parts already settled of rows in flight: a resume generates such a row again for the other policies only.
        self.partial = {(int(e), int(i)): dict(got) for e, i, got in state.get("partial", [])}
        self.part_outcomes = Counter(state.get("part_outcomes", {}))

    def settled_parts(self, epoch: int, index: int) -> dict[str, str]:
        """The policies that already settled their part of an in-flight row, with their outcome."""
        return self.partial.get((epoch, index), {})


class PartLedger:
    """One policy's part of the ledger (env.policies): what its buffer and learner loop settle."""

    def __init__(self, ledger: Ledger, policy: str) -> None:
        self.ledger, self.policy = ledger, policy

    def settle(self, epoch: int, index: int, outcome: str) -> None:
        self.ledger.settle_part(self.policy, epoch, index, outcome)

    def drop_episodes(self, n: int, reason: str) -> None:
        self.ledger.drop_episodes(n, f"{policy_label(self.policy)}:{reason}")
