"""Config sections of the scoring stage (`scoring`) and of on-policy distillation (`distill`).

`scoring` says where reward functions run (a thread pool in the orchestrator, a pool of worker
processes, or on the event loop as a blocking call), how many calls run at once, how long one
may take, how often a transient failure is retried, and how many groups may wait for scoring
before admission of new prompts slows. Optional scorers add to each sample's reward: a
group-level function, a reward model actor, a generative judge over HTTP, and process rewards
(per-step scores that become token-level advantages). `distill` names a teacher model whose
logprobs of the student's own tokens enter the advantage as a per-token reverse-KL term.
The rules across these and other sections live in `Config._scoring_rules` (config.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from nonstop.config.schema import Section as _Section

SHIPPED_TEACHER = Path(__file__).resolve().parents[1] / "assets" / "addition-teacher"


class RewardModelConfig(_Section):
    """A sequence-classification model (AutoModelForSequenceClassification, one label) scoring
    prompt + completion in its own actor process, restarted if it dies."""

    path: str
    """Local folder loadable with AutoModelForSequenceClassification.from_pretrained."""
    weight: float = 1.0
    """The model's score times this is added to each sample's reward."""
    batch_size: int = Field(32, ge=1)
    """Texts scored in one forward pass; requests arriving together are batched up to this."""
    max_restarts: int = Field(3, ge=0)
    """A dead reward-model actor is started again this many times before the run stops."""


class JudgeConfig(_Section):
    """A generative judge: any OpenAI-compatible /v1/completions endpoint (`nonstop serve` too)
    reads a prompt made from a template and answers with a verdict a regular expression parses."""

    url: str
    """Base URL of the server, e.g. http://127.0.0.1:8000 (the /v1/completions path is added)."""
    model: str = "judge"
    """The `model` field sent with each request."""
    template: str = "Question: {prompt}\nAnswer: {completion}\nReference: {answer}\nScore:"
    """Prompt of the judge; {prompt}, {completion} and {answer} are filled in."""
    pattern: str = r"-?\d+(?:\.\d+)?"
    """Regular expression whose first match in the judge's text is the score (group 1 if it has one)."""
    max_tokens: int = Field(8, ge=1)
    """Longest verdict the judge may write."""
    weight: float = 1.0
    """The parsed score times this is added to each sample's reward."""
    missing_score: float | None = None
    """Score of a verdict the pattern does not match; None: it is a failure (counted as judge_unparsed)."""


class ProcessRewardConfig(_Section):
    """Process rewards: the completion is cut into steps at `delimiter`, a function scores each
    step, and the scores become token-level advantages (trainer/token_advantages.py)."""

    fn: str
    """'package.module:function' called like a reward function (prompt, completion, answer, extra
    fields, steps) and returning one float per step."""
    delimiter: str = "\n"
    """Text that ends a step; the last step ends with the completion."""
    coef: float = Field(1.0, ge=0.0)
    """Weight of the process advantage added to the outcome advantage at every token."""


class ScoringConfig(_Section):
    pool: Literal["thread", "auto", "process", "loop"] = "thread"
    """Where reward functions run: 'thread' (a thread pool in the orchestrator: sync functions off
    the event loop, async ones on it), 'auto' (threads, with each sync function that measures
    slower than 2 ms per sample moved to `workers` worker processes, started then; one that cannot
    be sent there, a lambda or closure, stays on threads: for hosts with processors to spare),
    'process' (worker processes from the start; a call past its timeout kills its worker, which is
    replaced; needs functions named 'package.module:function', built-ins or module-level
    callables), 'loop' (called on the event loop, blocking it: generation and training wait while
    it runs)."""
    workers: int = Field(2, ge=1)
    """Worker processes of pool 'process', and of pool 'auto' once a slow function moves there."""
    concurrency: int = Field(256, ge=1)
    """Reward calls (one group's samples each) in flight at once, over the whole pool, and the
    pool's threads at most (started as calls need them): a sync function slower than 2 ms per
    sample takes one thread per sample, so a burst of groups under a slow verifier needs many."""
    timeout_s: float = Field(30.0, gt=0.0)
    """Longest one reward call may take before it counts as failed (reason 'timeout')."""
    retries: int = Field(1, ge=0)
    """A call that timed out or whose worker died is tried again this many times before it counts."""
    max_pending_groups: int = Field(256, ge=1)
    """Groups generated and waiting for (or under) scoring; while this many wait, no new prompt is
    admitted: a slow scorer slows generation instead of growing a queue."""
    group_reward: str | None = None
    """'package.module:function' called once per group with lists (prompts, completions, answers,
    extras) and returning one float per sample, added to each sample's reward times group_reward_weight."""
    group_reward_weight: float = 1.0
    """Weight of group_reward."""
    reward_model: RewardModelConfig | None = None
    """A reward model actor (None: none)."""
    judge: JudgeConfig | None = None
    """A generative judge over HTTP (None: none)."""
    process_reward: ProcessRewardConfig | None = None
    """Per-step process rewards (None: none)."""


class DistillConfig(_Section):
    """On-policy distillation: a teacher scores the student's own tokens; the per-token reverse KL
    log pi_student(a_t) - log pi_teacher(a_t) enters the advantage with weight -coef."""

    teacher: str | None = None
    """Folder of a causal LM sharing the student's tokenizer (checked at start-up); 'builtin': the
    shipped teacher for the built-in addition task (the shipped base after 1,500 steps of RL,
    nonstop/assets/addition-teacher, made by bench/make_teacher.py), resolved to its folder on
    load; None: off."""
    coef: float = Field(1.0, ge=0.0)
    """lambda: the advantage of token t becomes A_t - coef x (log pi_student(a_t) - log pi_teacher(a_t))."""
    normalize: bool = False
    """Standardise the per-token term over the batch's completion tokens before coef weighs it
    ((k - mean) / std): its scale then no longer depends on how far apart teacher and student are."""
    task_reward: bool = True
    """Keep the task reward's advantage (reward + distillation); false: the KL term alone (pure
    distillation; needs rollout.filter_uniform_reward=false)."""
    version: str | None = None
    """Recorded per sample with the teacher's path (None: the hash of its weights file)."""
    batch_size: int = Field(64, ge=1)
    """Sequences per teacher forward pass."""
    max_restarts: int = Field(3, ge=0)
    """A dead teacher actor is started again this many times before the run stops."""

    @field_validator("teacher")
    @classmethod
    def _shipped_teacher(cls, v: str | None) -> str | None:
        return str(SHIPPED_TEACHER) if v == "builtin" else v
