"""The run doctor's section of the run configuration (re-exported by nonstop.config).

The doctor (observe/doctor.py) watches a run's step records for the patterns that mean it has
stopped learning; each threshold below decides when one of them counts as seen. The defaults
were calibrated on real runs (docs/doctor.md): the default job stays silent, a run whose reward
pays for what held-out accuracy does not count is flagged. Rewards are read on their own scale,
so the reward thresholds assume rewards in [0, 1], as the built-in ones are.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from nonstop.config.schema import Section as _Section


class DoctorConfig(_Section):
    """The run doctor: findings in the progress output, summary.json and `nonstop report` (docs/doctor.md)."""

    enabled: bool = True
    """Watch the run's step records and report each pattern once, with its likely cause and the setting to try."""
    window_steps: int = Field(25, ge=2)
    """Trainer steps averaged at each end of a trend (early: the first window, late: the newest)."""
    min_steps: int = Field(50, ge=1)
    """No finding before this many trainer steps: the first steps of a run are noisy."""
    solved_accuracy: float = Field(0.9, gt=0.0, le=1.0)
    """At or above this held-out accuracy a run is solving its task: less signal and less entropy
    are then the policy being right, not collapsing, and those patterns are not reported."""
    reward_rise: float = Field(0.1, gt=0.0)
    """Reward-without-held-out: the reward per completion (over every group scored) rose at least this
    much since some evaluation at least min_steps steps and flat_evals evaluations back..."""
    heldout_flat: float = Field(0.03, ge=0.0)
    """... while no held-out accuracy after that evaluation exceeded its accuracy by this (a fraction:
    0.03 is 3 points; a held-out set of 500 prompts has a standard error of about 2 points)."""
    flat_evals: int = Field(3, ge=1)
    """Reward-without-held-out: the evaluations a flat span must hold at least."""
    signal_min_frac: float = Field(0.1, ge=0.0, le=1.0)
    """Signal collapse: fewer than this fraction of the groups scored in the newest window had
    rewards that differ (GRPO learns from those only)..."""
    signal_drop: float = Field(0.5, gt=0.0, le=1.0)
    """... and at most this fraction of the first window's."""
    entropy_min: float = Field(0.05, ge=0.0)
    """Entropy collapse: the sampled entropy (mean -log prob of the sampled tokens, nats per token)
    of the newest window fell below this..."""
    entropy_drop: float = Field(0.2, gt=0.0, le=1.0)
    """... and below this fraction of the first window's."""
    truncated_max_frac: float = Field(0.5, gt=0.0, le=1.0)
    """Length at the limit: at least this fraction of the newest window's completions were cut at
    rollout.max_new_tokens."""
    clip_max_frac: float = Field(0.3, gt=0.0, le=1.0)
    """Ratio clipping: the trainer clipped at least this fraction of tokens, averaged over the newest window."""
    below_base: float = Field(0.05, ge=0.0)
    """Held-out below the base: the newest evaluations were all more than this (a fraction) under the base's."""
    below_base_evals: int = Field(2, ge=1)
    """Held-out below the base: how many of the newest evaluations must be."""

    @model_validator(mode="after")
    def _windows_fit(self) -> "DoctorConfig":
        if self.min_steps < self.window_steps:
            raise ValueError(
                f"doctor.min_steps ({self.min_steps}) < doctor.window_steps ({self.window_steps}): a trend needs "
                "at least one window of steps; raise min_steps or lower window_steps"
            )
        return self
