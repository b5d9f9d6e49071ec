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
from nonstop.scoring.rewards import exact_match
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
class Vitals:
    """Sums over the groups scored (trained or dropped) since the learning loop last took them: what
    the run doctor reads (observe/doctor.py). The producer adds each scored group (`add`); each
    step record takes the means and starts a new window (`take`)."""

    groups: int = 0
    signal: int = 0  # groups whose rewards differ: GRPO learns from these only
    samples: int = 0
    reward: float = 0.0
    exact: int = 0  # completions that match their answer exactly (the held-out metric)
    tokens: int = 0  # model tokens (an environment's tokens carry no policy logprob)
    nll: float = 0.0  # -sum of their behaviour logprobs
    truncated: int = 0  # completions cut at max_new_tokens

    def add(self, group: Group) -> None:
        self.groups += 1
        self.signal += len({s.reward for s in group.samples}) > 1
        for s in group.samples:
            self.samples += 1
            self.reward += s.reward
            self.exact += exact_match(s.text, group.answer) > 0
            self.truncated += s.finish_reason == "length"
            if all(s.loss_mask):
                self.tokens += len(s.logprobs)
                self.nll -= sum(s.logprobs)
            else:
                model = [lp for lp, m in zip(s.logprobs, s.loss_mask) if m]
                self.tokens += len(model)
                self.nll -= sum(model)

    def take(self) -> dict[str, Any]:
        """The window's step-record fields (`ROLLOUT_FIELDS`; {} when no group was scored), then a new window."""
        if not self.samples:
            return {}
        n = self.samples
        out = {
            "rollout_groups": self.groups,
            "rollout_signal_groups": self.signal,
            "rollout_reward_mean": self.reward / n,
            "rollout_exact_frac": self.exact / n,
            "rollout_tokens_mean": self.tokens / n,
            "rollout_truncated_frac": self.truncated / n,
            "rollout_entropy": self.nll / self.tokens if self.tokens else None,
        }
        self.__init__()  # type: ignore[misc]
        return out


ROLLOUT_FIELDS = (
    "rollout_groups",
    "rollout_signal_groups",
    "rollout_reward_mean",
    "rollout_exact_frac",
    "rollout_tokens_mean",
    "rollout_truncated_frac",
    "rollout_entropy",
)
"""Step-record fields over every group scored since the previous step (Vitals.take)."""


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
    episodes: dict[str, Any] | None = None  # environment runs: EpisodeStats.report() (modes/environment/)
    policies: dict[str, Any] | None = None  # roles with their own policy: Policies.report() (modes/own_policies/)
    agents: dict[str, Any] | None = None  # agents over the API: AgentEndpoint.report() (modes/api_agents/)
    engine_flops_per_s: float | None = (
        None  # the engines' achieved FLOP/s since their last read (observe/flops.py FlopTally); None: unread
    )
    engine_peak_frac: float | None = None  # ... as a fraction of their matmul peak; None: engines without counts
    # over every group scored (trained or dropped) since the previous step (Vitals.take; None where
    # no group was, and in environment runs): what the run doctor reads (observe/doctor.py)
    rollout_groups: int | None = None  # groups scored
    rollout_signal_groups: int | None = None  # ... whose rewards differ (GRPO learns from these only)
    rollout_reward_mean: float | None = None  # reward per completion (reward_mean: the trained ones only)
    rollout_exact_frac: float | None = None  # completions that match their answer exactly
    rollout_tokens_mean: float | None = None  # model tokens per completion
    rollout_truncated_frac: float | None = None  # completions cut at rollout.max_new_tokens
    rollout_entropy: float | None = None  # sampled entropy: mean -behaviour logprob, nats per model token

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
        for optional in (
            "eval_accuracy",
            "episodes",
            "policies",
            "agents",
            "engine_flops_per_s",
            "engine_peak_frac",
            *ROLLOUT_FIELDS,
        ):
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
    """The base policy's held-out score, by `eval_metric` (the name keeps scripts reading the file working)."""
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
    agents: dict[str, Any] | None = None  # agents over the API: episodes and groups recorded, dropped, refused
    flops: dict[str, Any] = field(default_factory=dict)  # FlopTally.summary(): achieved FLOP/s, peak fractions
    pools: dict[str, Any] | None = (
        None  # local backend: CPU seconds, busy and idle per role's pool (runtime/pinning.py)
    )
    doctor: dict[str, Any] | None = None  # the run doctor's findings (observe/doctor.py Doctor.report())
    # transport.checksum: [policy_version, CRC32] of the trainer's final weights and of each engine's
    weights_crc32: dict[str, Any] | None = None
    engine_joins: list[dict] = field(default_factory=list)  # runtime.max_engines: each joined engine, when
    eval_metric: str = "exact_match"
    """What base_accuracy and final_accuracy measure: the task's reward on held-out completions (its name),
    'success' in an environment run."""
    eval_samples: int = 1
    """Completions per held-out prompt: 1 greedy, k > 1 mean@k sampled (task.eval_samples)."""
    eval_reward_failures: int = 0
    """Held-out completions whose reward raised or was not a number, over the run's evaluations (scored 0)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
