"""The task and warm-up sections of the run configuration (re-exported by nonstop.config).

`task` says where prompts and answers come from and how completions are rewarded; `warmup` how
the built-in tiny model becomes a weak, not blank, base policy before RL when no shipped base
fits. Rules that span sections live in `Config._combinations`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from nonstop.config.schema import Section as _Section


class TaskConfig(_Section):
    name: Literal["addition", "long_rollout", "jsonl"] = "addition"
    """Built-in two-operand addition ('07+45=' -> '52'); 'long_rollout', modular running sums with worked
    solutions of heavy-tailed length (docs/long_rollout.md); or prompts/answers from a JSONL file."""
    max_operand: int = Field(99, ge=1, le=9999)
    """Operands of the addition task are drawn from 0..max_operand."""
    pad_answer: bool = False
    """Zero-pad addition answers to one width ('07+45=' -> '052'), so every answer has the same length."""
    eval_size: int = Field(500, ge=1)
    """Number of held-out prompts (never trained on) used to measure accuracy; at most half the
    rows (the run says how many it took)."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Hold out this fraction of the rows (rounded, at least 1) instead of eval_size."""
    eval_path: str | None = None
    """JSONL file of held-out rows (task 'jsonl'): every dataset row trains; eval_size and
    eval_fraction are not used."""
    split_seed: int = 0
    """Seeds the shuffle that splits train and held-out prompts. Independent of run.seed, so every
    run seed measures the same held-out prompts, which the shipped base never trained on."""
    dataset_path: str | None = None
    """JSONL file with one {"prompt": ..., "answer": ...} object per line (task 'jsonl')."""
    reward: str = "exact_match"
    """'exact_match', 'partial_credit', 'last_number', 'math_verify', or 'package.module:function' taking
    (completion, answer) -> float. Held-out evaluation scores completions with this same reward."""
    eval_reward: str | None = None
    """The reward held-out evaluation scores with, a name as task.reward takes. None: task.reward itself,
    so that evaluation measures what training rewards. Set it to measure something else, e.g. train on a
    partial credit and evaluate by 'exact_match' (then the run doctor can see a reward rising while the
    held-out score stays flat)."""
    system_prompt: str | None = None
    """A system message put first in every chat row (rows given as `messages` or as a `prompt` list)
    that does not start with its own; rendered through the model's chat template (tasks/chat.py)."""
    chat_strings: bool = False
    """Render plain string prompts through the model's chat template too, as one user message (with
    system_prompt). False: string prompts reach the model as they are, as in TRL's standard format."""
    eval_samples: int = Field(1, ge=1, le=64)
    """Completions per held-out prompt. 1: one greedy completion each (eval_temperature 0). k > 1: the
    held-out score is mean@k, the mean reward of k completions sampled at eval_temperature."""
    eval_temperature: float | None = Field(None, ge=0.0)
    """Sampling temperature of held-out evaluation. None: 0 (greedy) with eval_samples 1, else
    rollout.temperature."""
    max_consecutive_reward_failures: int = Field(64, ge=1)
    """Groups in a row whose reward failed (raised or non-finite) before the run stops with the last error."""
    reward_fail_fast: bool = False
    """Stop the run at the first sample whose reward raised or was not finite, instead of counting it."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Prompts longer than this many tokens are bad rows (None: the model's max_position_embeddings
    minus rollout.max_new_tokens)."""
    on_bad_row: Literal["skip", "error"] = "skip"
    """A dataset row with missing fields or an over-long prompt: 'skip' reports it with its index and
    goes on; 'error' stops before training with the list of bad rows."""

    @model_validator(mode="after")
    def _dataset_needs_path(self) -> "TaskConfig":
        if self.name == "jsonl" and not self.dataset_path:
            raise ValueError("task 'jsonl' needs dataset_path")
        if self.eval_samples > 1 and self.eval_temperature == 0.0:
            raise ValueError("task.eval_samples: k > 1 greedy completions are all the same; set eval_temperature > 0")
        if self.eval_path is not None and (self.name != "jsonl" or self.eval_fraction is not None):
            raise ValueError("task.eval_path: held-out rows from a file need task 'jsonl', and no eval_fraction")
        return self


class WarmupConfig(_Section):
    enabled: bool | None = None
    """Train the built-in tiny model briefly (supervised) into a weak, not blank, base policy; cached on
    disk. None: on for the built-in tiny model, off with model.path (see Config.warmup_enabled)."""
    target_accuracy: float = Field(0.35, gt=0.0, le=1.0)
    """Stop the warm-up once held-out accuracy reaches this. 0.35 rather than 0.25: at 0.25 a base can
    cross by solving only the task's easy cases (subtraction without a borrow) and RL then sharpens
    those alone. With race_margin 3.0, the whole task matrix (8 tasks, seeds 0-2, 300 s each, warm-up
    included) gained at least +24.0 held-out points at 0.35, median +48.6; at 0.25 its subtraction seed
    2 gained +12.2 and multiply seed 0 +19.0 to +28.5 over four runs (docs/recipe.md, section 5)."""
    max_steps: int = Field(4000, ge=1)
    """Give up on the accuracy gate after this many steps."""
    max_time_s: float | None = Field(None, gt=0.0)
    """Give up on the accuracy gate after this many seconds: the base is the model as it is then
    (nonstop_base.json records why it stopped). None: half of run.max_total_s when that is set (the
    rest is RL's), else no limit. Not part of the warm-up cache's key: a base cut short by time is
    kept like one that reached the gate."""
    batch_size: int = Field(128, ge=1)
    """Examples per warm-up step. 128 with lr 2e-3 reached a 25% gate on arithmetic the tiny model found
    hard where 64 with 3e-3 did not: two-operand `2a + b` (examples/tasks/opsum.yaml) in 480 steps
    (46 s) against 1% after 3,061 steps (150 s); products of up to three digits
    (examples/tasks/multiply.yaml) in 600-1,080 steps over seeds 0-2, against 9.5% after 2,690 steps
    for seed 2 (docs/recipe.md, section 5)."""
    lr: float = Field(2e-3, gt=0.0)
    """AdamW learning rate of the warm-up. Higher rates made the gate's accuracy swing (opsum at 3e-3:
    7.5% then 0%) and never reached it on multiply (6e-3 and 1e-2: 0% after 150 s)."""
    eval_every: int = Field(10, ge=1)
    """Check the accuracy gate every this many steps. Often: accuracy jumps within tens of steps, and a
    base caught past its jump is confidently wrong where it is wrong, so RL gets little signal there
    (examples/tasks/compare.yaml: gated at step 50 a 70% base that RL lifted to 75%; at step 10 a
    46% base lifted to 95%; docs/recipe.md). A check is 200 greedy completions, about 1% of the
    warm-up's time at every 10 steps."""
    replay_crossing: bool = True
    """When a check crosses the gate, go back to the check before and replay those steps one at a
    time, so the warm-up stops at the first step at or above the target. Accuracy can jump within a
    few steps (reversal: from under 25% to 83% between checks 10 steps apart), and a base caught past
    its jump leaves RL little to gain. False: stop at the crossing check, as the bases shipped in
    nonstop/assets/ were made (with batch_size 64 and lr 3e-3; their provenance.json records it)."""
    racers: int = Field(2, ge=1, le=8)
    """Warm-ups of different seeds run side by side, one process each (racer i is seeded by the
    warm-up seed + 1000 * i); the one that crosses the gate in the fewest steps, racer 0's counted
    against the others' handicapped by race_margin, is kept (ties: the lower racer), so the result
    does not depend on timing. The step at which accuracy jumps varies widely with the seed (opsum:
    step 480 for seed 0, past 1,650 steps and the 150 s limit for seeds 1 and 2), and racers use the
    cores the actors take later. Under a time limit with no crossing,
    the best accuracy at the limit wins. 1: one warm-up, as the shipped bases were made."""
    race_margin: float = Field(3.0, ge=0.0, le=10.0)
    """A racer other than racer 0 (the run's own seed) wins only by crossing the gate in fewer steps
    than racer 0 by this factor: its crossing step counts times (1 + race_margin), so at 3.0 racer 0
    is kept whenever it crosses within four times the fastest other racer's steps. The other racers
    are a fallback for seeds whose warm-up does not cross in time (opsum seeds 1 and 2), not a
    contest: the fastest crosser can be a base that solved only the easy cases. Subtraction seed 2
    (examples/tasks/subtraction.yaml): racer 1 crossed a 25% gate at step 228, solving 2-7% of the
    prompts with a borrow, and RL lifted it +12.2 points in 300 s; racer 0 crossed at step 745, its
    accuracy even across cases, and RL lifted it +33.6 (docs/recipe.md, section 5). 0: the fewest
    steps wins outright."""
    threads: int = Field(1, ge=1)
    """torch threads of the warm-up. One: at the tiny shape a step's matmuls are too small for a
    second thread to pay, and on a machine whose cores are busy (other jobs) two threads waiting on
    each other ran 19x slower (200 steps of examples/tasks/subtraction.yaml: 291 s on 2 threads,
    15 s on 1, at load 6-8 on 2 cores; docs/recipe.md). The results are the same bytes either way
    on the machines measured."""
    cache_dir: str = ".nonstop_cache"
    """Where warmed-up base models are cached, keyed by a hash of everything that shapes them."""
    seed: int | None = None
    """Seeds the warm-up's initial weights and batch order; None: run.seed."""
