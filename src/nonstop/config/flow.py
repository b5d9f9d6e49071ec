"""The run's own sections, those no actor owns: rollout (sampling, group filtering, refill),
buffer (how far generation runs ahead), env (multi-turn environments), agents (agents over the
API), checkpoint, run (length, seed, run folder, live display, memory limit) and doctor (the
run doctor's thresholds).

A policy's sections (model, engine, trainer) are config/policy.py; rules that tie these sections
to others are checked in `Config` (config/root.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from nonstop.config.policy import PolicyConfig
from nonstop.config.schema import Section as _Section


class RolloutConfig(_Section):
    prompts_per_step: int = Field(32, ge=1)
    """Groups (prompts) per trainer step."""
    group_size: int = Field(8, ge=2)
    """Completions per prompt (GRPO's G); at least 2 so advantages are defined."""
    max_new_tokens: int = Field(4, ge=1)
    """Longest completion in tokens."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; behaviour logprobs are those of the tempered distribution."""
    top_k: int = Field(0, ge=0)
    """Sample from the k most likely tokens (0: off). The kept set is recorded and replayed by the trainer."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass (1.0: off). The kept set is recorded and replayed by the trainer."""
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    """Keep tokens with probability >= min_p x the top token's (0.0: off)."""
    filter_uniform_reward: bool = True
    """Drop (and count) groups whose samples all scored the same: they carry no GRPO signal."""
    refill: bool = True
    """With filter_uniform_reward: generate more prompts to replace the dropped groups, so every step
    trains on prompts_per_step groups (DAPO's dynamic sampling). false: a step trains on the groups
    with signal among its prompts_per_step prompts, as a plain synchronous loop does."""
    refill_ahead: bool | None = None
    """With refill: admit replacements for the groups still in flight that are expected to be
    dropped (from the drop rate seen lately) before they are scored, instead of one generate-and-score
    round trip per replacement while the trainer waits. A replacement that turns out not to be
    needed trains one step later (lag up to buffer.depth + 1). None: on when buffer.depth >= 1 and
    buffer.max_lag > buffer.depth; needs a bounded buffer.depth >= 1."""
    max_consecutive_uniform: int = Field(4096, ge=1)
    """Filtered groups in a row before the run stops: the policy never produces a learning signal."""
    seed_per_prompt: bool = False
    """Sample every completion from its own generator, seeded from (run.seed, epoch, prompt index,
    completion index): a prompt's completions then depend only on the weights that generate them,
    not on which engine or which batch served them, so a run resumed at depth 0 repeats the
    uninterrupted run's completions token for token (and so does a prompt re-generated after an
    engine restart). false: each engine draws from its own generator, which is faster (about
    10 us less per completion per token on CPU; on a GPU the seeded noise is drawn on the host)."""


class BufferConfig(_Section):
    depth: int | None = Field(1, ge=0)
    """Trainer steps of rollouts that may be generated ahead: 0 synchronous, 1 double buffer, K bounded,
    null unbounded stream."""
    max_lag: int = Field(2, ge=0)
    """Rollouts whose tokens are more than this many versions behind the trainer are rejected (counted)."""
    reject: Literal["group", "sample", "token", "episode"] = "group"
    """Granularity of max-lag rejection: drop whole groups in the buffer, or mask lagging samples or
    tokens out of the loss in the trainer (advantages still use the whole group); 'episode' drops, in
    the buffer, exactly the episodes of a group whose oldest model token lags (the rest trains)."""
    max_queued_groups: int = Field(4096, ge=1)
    """Hard bound on groups waiting in the buffer (back-pressure for the unbounded stream)."""


class EnvConfig(_Section):
    """Multi-turn and multi-agent episodes from an environment instead of single-turn prompts
    (docs/environments.md)."""

    name: str = "guess_number"
    """A built-in environment ('guess_number', 'calculator', 'nim') or 'package.module:factory', a
    callable with no arguments returning an Environment or a MultiAgentEnvironment (envs/base.py),
    whose task rows then come from the task section."""
    eval_name: str | None = None
    """Environment of the held-out evaluation (same forms as name); None: the same as name, except
    that 'nim' is evaluated against its scripted opponent ('nim_vs_random')."""
    max_turns: int = Field(4, ge=1)
    """Model turns per role in one episode; an episode that reaches it ends (truncated)."""
    max_episode_tokens: int = Field(96, ge=2)
    """Tokens in one role's sequence, prompt included (keep it within the model's positions)."""
    turn_max_tokens: int = Field(4, ge=1)
    """Tokens the model may write in one turn; a turn also ends at EOS."""
    step_timeout_s: float = Field(10.0, gt=0.0)
    """Wall-clock bound of one reset or step of the environment; past it the episode fails (counted)."""
    baseline: Literal["group", "ema"] | None = None
    """Advantage baseline per role: 'group' (GRPO over the episodes of one task row) or 'ema' (an
    exponential moving average of the role's rewards: for zero-sum self-play, where a group mean is
    about 0); None: 'group' with one role, 'ema' with several."""
    ema_decay: float = Field(0.9, ge=0.0, lt=1.0)
    """Weight of the old value in the per-role EMA baseline."""
    train_rows: int = Field(2048, ge=1)
    """Task rows a built-in environment generates for training."""
    eval_rows: int = Field(200, ge=1)
    """Held-out rows of a built-in environment (another seed); one episode each per evaluation."""
    task_options: dict[str, Any] = {}
    """Keyword arguments of a task source's generator: for 'reasoning_gym/<dataset>', the dataset's
    own config fields (e.g. chain_sum's min_terms, max_digits); unknown ones are refused at start."""
    max_consecutive_errors: int = Field(64, ge=1)
    """Episode groups in a row failed by the environment (raised or timed out) before the run stops."""
    policies: dict[str, PolicyConfig] = {}
    """Roles that play their own policy, by role name (each with its own model, engines, trainer,
    transport and policy_version); roles not named play the run's shared policy (self-play)."""
    verifiers_rollout: Literal["chat_loop", "agent"] = "chat_loop"
    """Who plays a verifiers taskset's episodes (env.name 'verifiers/...'): 'chat_loop', nonstop's chat
    loop through verifiers' model-call path (a wrong answer retried with a user message); 'agent',
    verifiers' own Agent.run (its rollout, interception server, MCP tool servers and its null harness's
    chat program, run in process), which a taskset with tools needs."""

    @model_validator(mode="after")
    def _verifiers_only(self) -> "EnvConfig":
        if self.verifiers_rollout != "chat_loop" and not self.name.startswith("verifiers/"):
            raise ValueError(
                f"env.verifiers_rollout: {self.verifiers_rollout!r} applies to a verifiers taskset "
                f"(env.name 'verifiers/...'), not to {self.name!r}; leave it unset"
            )
        return self


class AgentsConfig(_Section):
    """Agents over the API (docs/api_agents.md): the run serves an OpenAI-compatible endpoint in
    front of its engines; episodes the agents play under an episode id and reward are its only
    training data (groups of rollout.group_size episodes)."""

    enabled: bool = False
    """Serve the endpoint and train on the agents' rewarded episodes instead of the run's own prompts."""
    host: str = "127.0.0.1"
    """Address the endpoint binds (loopback by default)."""
    port: int = Field(0, ge=0, le=65535)
    """Port of the endpoint; 0 picks a free one. The bound address is printed and written to
    RUN_DIR/endpoint.json."""
    model_name: str = "policy"
    """The model name the endpoint serves (what agents pass as `model`)."""
    api_key: str | None = None
    """When set, requests need `Authorization: Bearer <api_key>`."""
    episode_timeout_s: float = Field(60.0, gt=0.0)
    """A group whose episodes saw no request and no reward for this long is dropped, counted (abandoned)."""
    max_open_episodes: int = Field(512, ge=1)
    """Episodes held at once (open, or rewarded and waiting for training); past it new episodes get 429."""
    linger_s: float = Field(10.0, ge=0.0)
    """After the last trainer step, keep serving the final policy (requests without an episode id)
    until no request came for this long, so agents can measure it."""


class CheckpointConfig(_Section):
    every_steps: int | None = Field(50, ge=1)
    """Write a checkpoint every this many trainer steps (and at the end); None: only the final weights."""
    keep: int = Field(3, ge=1)
    """How many of the newest checkpoints to keep; older ones are deleted after a new one is complete."""


class RunConfig(_Section):
    max_steps: int = Field(1000, ge=1)
    """Trainer steps (each publishes policy_version + 1)."""
    max_epochs: int | None = Field(None, ge=1)
    """Stop after this many passes over the train split (the last batch may be short); None: no limit."""
    max_time_s: float | None = Field(190.0, gt=0.0)
    """Stop RL after this many seconds of wall time (None: only max_steps)."""
    max_total_s: float | None = Field(None, gt=0.0)
    """Stop RL so that the whole command ends within about this many seconds: preparing the base
    policy (a warm-up), starting the actors and the base evaluation count too. RL gets what they
    left, less the final evaluation (as long as the base evaluation took) and 10 s for the save,
    and at most max_time_s; no step is started that, as long as the last one, would end past it
    (None: no such bound). Counted per session when a run is resumed."""
    eval_every: int = Field(25, ge=1)
    """Measure held-out accuracy every this many steps (greedy decoding on the engine)."""
    eval_pauses_generation: bool = False
    """From the start of a step that evaluates (every eval_every steps, and the last) until its
    evaluation ends, admit no group beyond what that step could admit: groups already generating
    finish, the next batch starts after the evaluation. The evaluation then shares the engines
    only with work already under way, and the seconds it takes generate nothing that the clock
    without them would miss: for comparing runs by RL time with evaluation left out
    (bench/real_model.py), since otherwise a depth-0 run generates its next batch during each
    evaluation and a deeper one mostly cannot. Costs that generation time in wall-clock terms."""
    seed: int = 0
    """Seeds the model init, the data order and sampling."""
    out_dir: str = "runs"
    """Parent folder of run folders."""
    name: str | None = None
    """Run folder name; default is a timestamp."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Live display: rich on a terminal, plain lines otherwise."""
    memory_limit_gib: float | None = Field(None, gt=0.0)
    """Memory the run's processes may hold together, in GiB. None: what the machine has available
    at start (the cgroup's limit minus its usage if a limit is set, else MemAvailable). The run's
    memory plan must fit in it or the run is refused before any actor starts; it also scales the
    engines' KV budget (engine.kv_cache_fraction). docs/memory.md."""
    memory_headroom: float = Field(0.3, ge=0.0, le=2.0)
    """Headroom the memory plan adds to each process that holds a model and to the orchestrator, as a fraction of that
    process's estimated items (activations, attention temporaries, logits, the runtime; weights,
    optimizer states and caches are counted exactly): the allocator's fragmentation and the
    temporaries the estimates leave out. 0.3 covers what SmolLM2-135M's default batch measured above
    them (the engine 28% of its estimates, the trainer 17%; docs/memory.md). It counts against
    run.memory_limit_gib."""
    spans: bool = True
    """Write the span log (RUN_DIR/spans/*.jsonl: every group's life, every actor's busy intervals),
    which `nonstop report` and `nonstop simulate` read; costs well under 1% of samples/s (docs/observability.md)."""

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v


# The doctor (observe/doctor.py) watches a run's step records for the patterns that mean it has
# stopped learning; each threshold below decides when one of them counts as seen. The defaults
# were calibrated on real runs (docs/doctor.md): the default job stays silent, a run whose reward
# pays for what held-out accuracy does not count is flagged. Rewards are read on their own scale,
# so the reward thresholds assume rewards in [0, 1], as the built-in ones are.
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
