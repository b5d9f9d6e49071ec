"""What a run reports: one `StepRecord` per trainer step and one `RunSummary` at the end.

`StepRecord.to_dict()` is one line of `metrics.jsonl` and `RunSummary.to_dict()` is
`summary.json`; their keys are the files' format, read by the benches, the tests and users'
scripts, so a field renamed here renames a column there. The trainer's own step metrics (loss,
ratios, lag histogram, train_s, publish_s, publish_bytes, ...) travel as one dict, flattened
into the record, because the loss family decides which ones exist.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

from nonstop.clients import EngineStats
from nonstop.types import Group


def completions_crc32(groups: list[Group]) -> int:
    """CRC32 over each group's (epoch, prompt index) and its samples' completion token ids, in order."""
    crc = 0
    for g in groups:
        crc = zlib.crc32(f"{g.epoch},{g.prompt_index}:".encode(), crc)
        for s in g.samples:
            crc = zlib.crc32((",".join(map(str, s.completion_ids)) + ";").encode(), crc)
    return crc


@dataclass
class StepRecord:
    step: int
    policy_version: int  # published at the end of this step
    time_s: float  # RL wall time so far
    reward_mean: float  # over the samples trained in this step
    prompts: list[list[int]]  # [epoch, prompt index] of each group trained
    completions_crc32: (
        int  # of the trained groups' completion token ids: equal in two runs that trained on the same tokens
    )
    trainer: dict[str, Any]  # the trainer's metrics of this step and of its publish
    samples_trained: int
    samples_generated: int  # so far, by every engine
    samples_per_s: float
    generation_busy_s: float
    generation_idle_s: float
    training_busy_s: float
    training_idle_s: float
    engine_idle_frac: float
    trainer_idle_frac: float
    drops: dict[str, int]  # groups not trained, by reason, so far
    reward_errors: dict[str, int]
    buffer_queued: int
    engine_restarts: int
    prompts_requeued: int
    engine_versions: list[int]  # newest policy_version seen in each engine's tokens
    eval_accuracy: float | None = None  # held-out accuracy, on the steps that evaluate
    scoring: dict[str, Any] = field(default_factory=dict)  # the scoring stage's metrics of this step (latency, queue)
    episodes: dict[str, Any] | None = None  # environment runs: EpisodeStats.report() (episode_flow.py)
    policies: dict[str, Any] | None = None  # roles with their own policy: Policies.report() (policies.py)
    engine_flops_per_s: float | None = (
        None  # the engines' achieved FLOP/s since the last record (observe/flops.py FlopTally)
    )
    engine_peak_frac: float | None = None  # ... as a fraction of their matmul peak; None: engines without counts

    @property
    def lag_hist(self) -> dict[str, int]:
        """Trained tokens by lag (policy_version of the trainer minus the token's)."""
        return self.trainer["lag_hist"]

    @property
    def skipped_steps(self) -> int:
        return self.trainer["skipped_steps"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        trainer = d.pop("trainer")
        scoring = d.pop("scoring")
        head = {k: d.pop(k) for k in ("step", "policy_version", "time_s", "reward_mean", "prompts")}
        for optional in ("eval_accuracy", "episodes", "policies", "engine_flops_per_s", "engine_peak_frac"):
            if d[optional] is None:
                del d[optional]
        return {**head, **trainer, **scoring, **d}

    def final_eval(self) -> dict[str, Any]:
        """The extra line written when the run ended between two evaluations."""
        return {
            "step": self.step,
            "policy_version": self.policy_version,
            "eval_accuracy": self.eval_accuracy,
            "final_eval": True,
        }


@dataclass
class RunSummary:
    base_accuracy: float
    final_accuracy: float | None
    steps: int
    policy_version: int
    rl_wall_s: float
    samples_generated: int
    samples_per_s: float
    engine_idle_frac: float
    trainer_idle_frac: float
    drops: dict[str, int]
    reward_errors: dict[str, int]
    skipped_steps: int
    engines: list[EngineStats]  # each engine's counters at the end
    last_reward_error: str | None
    final_dir: str
    prompts: dict[str, Any]  # the prompt ledger's report (orchestrator/ledger.py)
    engine_faults: dict[str, Any]  # restarts and re-queued prompts (runtime/restart.py)
    resumed_from: str | None
    last_checkpoint: int | None
    run_dir: str
    # what preparing the run took, outside the RL run itself (filled by the caller that prepared it)
    wall_s: float = 0.0
    warmup_s: float = 0.0
    dataset_rows_skipped: int = 0
    episodes: dict[str, Any] | None = None  # environment runs: the episode counters at the end
    policies: dict[str, Any] | None = None  # roles with their own policy: each policy's counters and final weights
    flops: dict[str, Any] = field(default_factory=dict)  # FlopTally.summary(): achieved FLOP/s, peak fractions
    pools: dict[str, Any] | None = (
        None  # local backend: CPU seconds, busy and idle per role's pool (runtime/pinning.py)
    )
    # transport.checksum: [policy_version, CRC32] of the trainer's final weights and of each engine's
    weights_crc32: dict[str, Any] | None = None
    engine_joins: list[dict] = field(default_factory=list)  # runtime.max_engines: each joined engine, when

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
