"""What the capacity planner knows about a pipeline: rates and sizes, calibrated or stated.

`PlanParams` holds the cost model (docs/planning.md has the equations); every time is what the
actor needs when it has a processor to itself:

- engine forward pass: tau(B) = pass_s + pass_row_s x B + pass_read_s x K, B the rows
  (sequences) in the pass, every row emitting one token, K the cached positions its decode
  attention reads, padding included: rows sorted by length in blocks of ATTN_BLOCK, each
  reading up to its longest row (engine/blocks.py), a row's keys its `prompt_len` prompt tokens
  (the mean) plus the tokens it made so far;
- trainer step on T completion tokens over R ranks: step_s + step_token_s x T / R; with
  `forward_ahead`, a trainer waiting for its batch runs the forward of the groups it holds
  whenever none is queued, at ahead_frac x step_token_s per token, and the step is that much
  shorter;
- publish_s per weight publish (trainer side), apply_s per version made live (engine side);
- the orchestrator, one thread doing one thing at a time, in order: `orch_group_s` per finished
  group (receive, decode, hand to scoring); the groups of one busy stretch are buffered together
  `deliver_delay_s` after it ends (their scores come back from the scoring threads); a pause of
  `pause_s` every `pause_every` groups (garbage collection mostly, which comes with the objects
  it makes; 0: none seen); `call_sample_s` per sample to hand a batch to the trainer before the
  step begins (pickling and sending it); `loop_s` between the step and the publish (taking the
  result, calling the publish, the step's records); admitted groups are sent once it is free,
  as the producer runs on the same event loop;
- wake_s, wake_call_s: an idle engine's first pass starts wake_s + wake_call_s per call it
  got meanwhile after the first call of an admission reaches it (its actor reads and submits
  the calls waiting for it first, so they join together);
- admit_delay_s (admission -> its first engine call); `admit_delays`, when measured, each
  admission's, are resampled instead of the mean; `admit_gap_s` between one admission's calls
  (the producer sends them one after another in one turn of its loop);
- pickup_passes: the pass boundaries a call that reaches a busy engine waits before the one at
  which it joins: 2 for nonstop's engine (its loop runs the next pass before its reader takes
  the call, and the one after before the call's task submits it), 0 when it joins at the next;
- return_passes: passes a finished group's answer waits while its engine has more to decode
  (nonstop's engine: 1, the loop runs the next pass before the call's task sends the answer);
- completion lengths: `groups_lens`, the completion lengths of real groups, resampled whole; or,
  when stated instead of measured, a log-normal with median `len_median` and shape `len_sigma`,
  cut at `len_max` (the long tail of reasoning outputs);
- drop_frac: the share of groups dropped without learning signal (refunded and replaced);
- eval_s: one held-out evaluation;
- cores: processors shared by the engines, the trainer ranks and the orchestrator (local CPU
  processes: the host's, or fewer, fitted, when other sessions took a share: the kernel shares
  the processors between sessions first); while n of them are busy each runs at
  min(1, cores / n) of its speed.
  None: each engine and rank has its own accelerator, and only the orchestrator's order matters.

`nonstop.planner.calibrate` fits them to a run's span log. `Shape` is what the planner may
change: engines, trainer ranks, depth, max_lag, batch. `Prediction` is what the model
(planner/model.py) says of a pipeline: samples/s, idle fractions, the lag histogram.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nonstop.sizing.defaults import DEFAULT_SLOTS

if TYPE_CHECKING:
    from nonstop.config import Config


@dataclass(frozen=True)
class Shape:
    """The pipeline's shape: what a sweep varies."""

    engines: int = 1
    trainer_ranks: int = 1
    depth: int | None = 1  # None: unbounded stream
    max_lag: int | None = 2  # None: no rejection
    prompts_per_step: int = 32
    group_size: int = 8
    slots: int = 256  # engine.max_concurrent_seqs
    steps: int = 60
    eval_every: int | None = None
    max_queued: int = 4096  # buffer.max_queued_groups: the unbounded stream's bound
    refill_ahead: bool = False  # rollout.refill_ahead resolved: admission anticipates the drops
    forward_ahead: bool = (
        False  # trainer.forward_ahead resolved: a waiting trainer runs the forwards of the groups it holds
    )

    def label(self) -> str:
        depth = "inf" if self.depth is None else str(self.depth)
        return f"engines={self.engines} ranks={self.trainer_ranks} depth={depth} batch={self.prompts_per_step}"

    @classmethod
    def of(cls, cfg: Config) -> "Shape":
        return cls(
            cfg.runtime.num_engines,
            cfg.trainer.ranks,
            cfg.buffer.depth,
            cfg.buffer.max_lag if cfg.buffer.reject == "group" else None,
            cfg.rollout.prompts_per_step,
            cfg.rollout.group_size,
            cfg.engine.max_concurrent_seqs or DEFAULT_SLOTS,  # unset: at most 256 (sizing/defaults.py)
            cfg.run.max_steps,
            cfg.run.eval_every,
            cfg.buffer.max_queued_groups,
            cfg.refill_ahead,
            cfg.forward_ahead,
        )


@dataclass(frozen=True)
class PlanParams:
    pass_s: float
    pass_row_s: float
    step_s: float
    step_token_s: float
    publish_s: float
    apply_s: float
    groups_lens: list[list[int]] = field(default_factory=list)
    pass_read_s: float = 0.0
    prompt_len: float = 0.0
    ahead_frac: float = 0.0
    len_median: float = 0.0
    len_sigma: float = 1.0
    len_max: int = 0
    admit_delay_s: float = 0.0
    admit_delays: list[float] = field(default_factory=list)
    admit_gap_s: float = 0.0
    deliver_delay_s: float = 0.0
    orch_group_s: float = 0.0
    pause_s: float = 0.0
    pause_every: float = 0.0
    call_sample_s: float = 0.0
    loop_s: float = 0.0
    pickup_passes: int = 0
    return_passes: int = 0
    send_s: float = 0.0
    wake_s: float = 0.0
    wake_call_s: float = 0.0
    drop_frac: float = 0.0
    eval_s: float = 0.0
    cores: float | None = None
    calibrated_on: Shape | None = None

    def describe(self) -> str:
        """The costs on one line, for people."""
        cores = "none" if self.cores is None else f"{self.cores:g}"
        return (
            f"pass {self.pass_s * 1e3:.2f} ms + {self.pass_row_s * 1e6:.1f} us/row + "
            f"{self.pass_read_s * 1e9:.1f} ns/read (prompts {self.prompt_len:.0f}), step {self.step_s * 1e3:.1f} ms + "
            f"{self.step_token_s * 1e6:.1f} us/token, publish {self.publish_s * 1e3:.1f} ms, apply "
            f"{self.apply_s * 1e3:.1f} ms; orchestrator {self.orch_group_s * 1e3:.2f} ms/group, handoff "
            f"{self.deliver_delay_s * 1e3:.1f} ms, pause {self.pause_s * 1e3:.0f} ms per {self.pause_every:.0f} "
            f"groups, send {self.send_s * 1e3:.2f} ms/group, wake {self.wake_s * 1e3:.2f} ms + "
            f"{self.wake_call_s * 1e3:.2f} ms/call, batch call {self.call_sample_s * 1e6:.1f} us/sample, "
            f"loop {self.loop_s * 1e3:.1f} ms; "
            f"drop {self.drop_frac:.2f}; shared cores {cores}; {len(self.groups_lens)} groups' completion lengths"
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PlanParams":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown planner cost(s) {unknown}: the costs are {[f.name for f in fields(cls)]}")
        shape = d.get("calibrated_on")
        return cls(**{**d, "calibrated_on": Shape(**shape) if shape else None})

    @classmethod
    def load(cls, path: Path | str) -> "PlanParams":
        """From JSON (as `to_json` writes) or YAML with the same keys."""
        return cls.from_dict(yaml.safe_load(Path(path).read_text()))

    def with_lens(self, lens: list[list[int]]) -> "PlanParams":
        return replace(self, groups_lens=lens)


@dataclass
class Prediction:
    samples_per_s: float
    engine_idle: float
    trainer_idle: float
    lag_hist: dict[int, int]
    wall_s: float
    dropped_for_lag: int = 0

    @property
    def mean_lag(self) -> float:
        total = sum(self.lag_hist.values())
        return sum(k * v for k, v in self.lag_hist.items()) / total if total else 0.0
