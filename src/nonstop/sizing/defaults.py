"""Defaults that follow from the run and the model: engine limits and the learning rate (docs/memory.md).

Config fields left None here resolve in one place each, and a training run resolves them all
once, before any actor starts (`size_run`), so every actor gets concrete numbers:

- `engine.max_seq_len` / `engine.vllm.max_model_len`: what the run needs, the longest admitted
  prompt + rollout.max_new_tokens (an environment run: env.max_episode_tokens, which bounds a
  role's whole sequence), at most the model's max_position_embeddings (`run_seq_len`). An
  engine built outside a run (`nonstop serve`, tests) has no run to ask: the model's
  max_position_embeddings, at most 4096 (`engine_limits`).
- `engine.max_concurrent_seqs`: 256, or fewer when 256 sequences of max_seq_len tokens would
  not fit the KV budget, `engine.kv_cache_fraction` of the machine's memory (the cgroup limit,
  else RAM; run.memory_limit_gib when set) shared by the engines, but never fewer than one
  group (rollout.group_size) needs (`engine_slots`); the memory plan then decides whether the
  run fits at all.
- `trainer.lr`: 6e-4 for the built-in tiny model (the value its default job was tuned with);
  a task's shipped base (`task.name: long_rollout`) takes the value measured for it
  (TASK_BASE_LR); a base the supervised warm-up builds on the user's task (model.base warmup, or
  auto without a fitting shipped base) takes WARMUP_BASE_LR;
  for a loaded model (model.path) 1e-5 x sqrt(1e8 / N) for N parameters, kept within
  [1e-6, 1e-5] (about 4.5e-6 at 0.5B, 1.2e-6 at 7B), times 10 with LoRA, where only the
  adapters learn (`learning_rate`).
- `trainer.micro_batch_tokens` (one trainer rank): the whole batch's forward tokens
  (`forward_tokens`: each prompt once plus every completion, as the shared-prompt forward runs
  them) when their activations fit ACTIVATION_FRACTION of the machine's memory (run.memory_limit_gib
  when set), so a small job keeps one forward per step; else the tokens whose activations do
  (`micro_batch_tokens`), never below one sequence; the memory plan then counts one micro-batch.
- `engine.dtype` / `trainer.precision`: auto for a loaded model of at least AUTO_BF16_MIN_PARAMS
  parameters (bf16 where the actor's device has it, decided in the actor: device.py); left None
  otherwise, which keeps the built-in tiny model's default job in float32 on the CPU
  (docs/precision.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nonstop.config import Config, EngineConfig
from nonstop.config.policy import TINY_MODEL_LR
from nonstop.device import compile_blocker, dtype_name, resolve_device, resolve_dtype
from nonstop.sizing.machine import machine_memory
from nonstop.sizing.shape import ModelShape

DEFAULT_SLOTS = 256
"""engine.max_concurrent_seqs when unset and the KV budget allows it."""
UNBOUND_MAX_SEQ_LEN = 4096
"""engine.max_seq_len of an engine built without a run (serve), when the model allows more."""
LOADED_LR_REF = 1e-5
"""trainer.lr of a loaded model of 1e8 parameters; it falls with the square root of the size."""
LOADED_LR_RANGE = (1e-6, 1e-5)
LORA_LR_FACTOR = 10.0
TINY_LR_MAX_PARAMS = 10_000_000
"""A loaded model below this size is of the tiny family (a `nonstop warmup` base, the examples' students):
it keeps the tiny model's trainer.lr, the value those shapes were tuned with, not the rule for real models."""
TASK_BASE_LR = {"long_rollout": 1e-4}
"""trainer.lr of the bases shipped for a task (model.base auto/builtin, no model.path). The long-rollout
base writes ~150 tokens per completion, so one update moves a whole completion's logprob ~150 times
as far as a 4-token answer's: at the tiny model's 6e-4 (and at 1e-3) the depth-2 example's
behaviour/trainer KL rose to 0.03-0.16 within 6 steps and the training reward fell from 0.48 to
0.20-0.25 (the base collapsing); at 1e-4 the KL stayed near 1e-4 and held-out accuracy went from
31% to 48% at step 10 and 53% at step 20 (docs/long_rollout.md)."""
WARMUP_BASE_LR = 3e-4
"""trainer.lr of a base the warm-up builds on the user's task (docs/recipe.md, section 5). Such a base
sits just past its accuracy jump; at the tiny model's 6e-4 RL lifted it as much or less on every task
of the matrix measured at both rates (examples/tasks/: sumdiff seed 2 +13.6 points at 6e-4 against
+26.4 at 3e-4 in the same time; at 1.2e-3 sumdiff seed 0 fell to +0.4 with the doctor flagging
signal collapse). The default job's shipped base keeps 6e-4, the value it was tuned with."""
GIB = 1024**3
AUTO_BF16_MIN_PARAMS = 50_000_000
"""engine.dtype and trainer.precision left None resolve to auto from this size of loaded model up: below
it, per-token overheads rather than matmuls bound a CPU step, so bf16 gains little and float32 keeps
small runs (and the tests' small saved models) comparable across CPU kinds."""


SHARED_PROMPT_TYPES = ("qwen2", "llama")
"""Models the trainer's shared-prompt forward takes (trainer/forward.py SUPPORTED_TYPES)."""
ACTIVATION_FRACTION = 0.25
"""trainer.micro_batch_tokens when unset: one micro-batch's activations within this fraction of the
machine's memory (run.memory_limit_gib when set), as engine.kv_cache_fraction bounds the KV cache."""


def forward_tokens(cfg: Config, shape: ModelShape, seq: int) -> tuple[int, int, int]:
    """(tokens one trainer rank's forward holds, its rows, completion tokens per row). Single-turn
    batches on Qwen2/Llama run each prompt once and the completions against it (trainer/forward.py):
    groups x prompt + rows x completion; otherwise (episodes, other models, fsdp2) rows x sequence."""
    r, t = cfg.rollout, cfg.trainer
    rows = math.ceil(r.prompts_per_step * r.group_size / t.ranks)
    if cfg.env is not None:
        return rows * seq, rows, seq
    new = min(r.max_new_tokens, seq)
    if shape.model_type in SHARED_PROMPT_TYPES and not (t.ranks > 1 and t.data_parallel == "fsdp2"):
        groups = math.ceil(r.prompts_per_step / t.ranks)
        return groups * (seq - new) + rows * new, rows, new
    return rows * seq, rows, new


def micro_batch(cfg: Config, shape: ModelShape, seq: int) -> tuple[int, int, int]:
    """(tokens, rows, completion tokens per row) of the largest forward one trainer rank runs at
    once: the whole batch's (`forward_tokens`), or with trainer.micro_batch_tokens below it, that
    budget and the share of the rows it holds (at least one row: a sample is never cut)."""
    tokens, rows, new = forward_tokens(cfg, shape, seq)
    budget = cfg.trainer.micro_batch_tokens
    if budget is None or budget >= tokens:
        return tokens, rows, new
    return budget, max(1, min(rows, math.ceil(rows * budget / tokens))), new


def micro_batch_tokens(cfg: Config, shape: ModelShape, seq: int, memory: float) -> tuple[int, str]:
    """trainer.micro_batch_tokens of a run that left it unset (one trainer rank): the whole batch's
    forward tokens when its activations fit ACTIVATION_FRACTION of `memory` bytes, else the tokens
    that do (at least one sequence of `seq` tokens); and why."""
    tokens, _, _ = forward_tokens(cfg, shape, seq)
    per_token = shape.activation_bytes_per_token(cfg.trainer.activation_checkpointing)
    fit = int(ACTIVATION_FRACTION * memory // per_token)
    share = f"{ACTIVATION_FRACTION:g} of {memory / GIB:.1f} GiB at {per_token:,} bytes of activations per token"
    if tokens <= fit:
        return tokens, f"the whole batch's forward: it fits {share}"
    return max(fit, seq), f"the batch's {tokens:,} forward tokens do not fit {share}: micro-batches"


def run_seq_len(cfg: Config, longest_prompt: int, max_positions: int) -> int:
    """The longest sequence a training run's engines see (prompt + completion), in tokens."""
    need = cfg.env.max_episode_tokens if cfg.env is not None else longest_prompt + cfg.rollout.max_new_tokens
    return max(2, min(need, max_positions))


def engine_slots(seq_len: int, kv_bytes_per_token: int, budget_bytes: float, at_least: int) -> int:
    """Sequences the built-in engine decodes together when engine.max_concurrent_seqs is unset:
    DEFAULT_SLOTS, fewer if their KV cache would exceed `budget_bytes`, never below `at_least`."""
    fit = int(budget_bytes // max(1, seq_len * kv_bytes_per_token))
    return max(at_least, min(DEFAULT_SLOTS, fit))


VLLM_BLOCK_TOKENS = 128
"""KV block size the need is rounded up to per sequence (vLLM's CPU backend allocates in blocks)."""
VLLM_MIN_KV_GIB = 1 / 16
"""Least KV cache a sized vLLM engine gets."""
VLLM_UNSET_DTYPE = "float32"
"""What vLLM runs in when engine.vllm.dtype is None: left unresolved outside a training run's sizing
(`nonstop serve`); engine/vllm/setup.py's engine_args and the memory plan both read it."""


def vllm_dtype(dtype: str | None, shape: ModelShape) -> str:
    """The dtype vLLM runs in: engine.vllm.dtype, whose 'auto' loads what config.json records and
    whose None is VLLM_UNSET_DTYPE."""
    return (shape.dtype if dtype == "auto" else dtype or VLLM_UNSET_DTYPE).replace("torch.", "")


def vllm_kv_gib(max_num_seqs: int, max_model_len: int, shape: ModelShape, dtype: str | None) -> float:
    """engine.vllm.kv_cache_gib of a training run that set neither it nor memory_fraction: what
    max_num_seqs sequences of max_model_len tokens need (whole blocks), like the built-in engine's
    cache, so a large model's weights do not eat a fixed fraction of the machine meant for both."""
    name = vllm_dtype(dtype, shape)
    nbytes = 4 if name == "float32" else 2
    blocks = -(-max_model_len // VLLM_BLOCK_TOKENS)
    need = max_num_seqs * blocks * VLLM_BLOCK_TOKENS * shape.kv_bytes_per_token(nbytes)
    return round(max(need / GIB, VLLM_MIN_KV_GIB), 4)


def engine_calls_bound(cfg: Config) -> int:
    """Groups at most inside engine calls at once (orchestrator/generate.py Production.max_in_flight):
    twice what the engines decode together, so each engine always has a group queued behind its
    batch and no more (unset engine.max_concurrent_seqs counts as DEFAULT_SLOTS)."""
    slots = cfg.engine.max_concurrent_seqs or DEFAULT_SLOTS
    return max(1, 2 * cfg.runtime.num_engines * slots // cfg.rollout.group_size)


def engine_limits(
    settings: EngineConfig,
    max_positions: int,
    kv_bytes_per_token: int,
    memory_bytes: float | None = None,
    engines: int = 1,
    at_least: int = 1,
) -> tuple[int, int]:
    """(max_seq_len, max_concurrent_seqs) of a built-in engine: the settings where set, else an
    engine outside a run's rule (see the module docstring). `memory_bytes` None reads the machine's."""
    seq_len = settings.max_seq_len or min(max_positions, UNBOUND_MAX_SEQ_LEN)
    if settings.max_concurrent_seqs is not None:
        return seq_len, settings.max_concurrent_seqs
    if memory_bytes is None:
        memory_bytes = machine_memory().total
    budget = settings.kv_cache_fraction * memory_bytes / engines
    return seq_len, engine_slots(seq_len, kv_bytes_per_token, budget, at_least)


def learning_rate(cfg: Config, params: int | None, warmed_up: bool = False) -> tuple[float, str]:
    """trainer.lr resolved, and where the value comes from (for the start-up log).
    `params`: the loaded model's parameter count (None: the built-in tiny model). `warmed_up`: the
    run starts from a base the warm-up builds on its task (models/base_policy.py `choose_base` says 'warmup')."""
    if cfg.trainer.lr is not None:
        return cfg.trainer.lr, "trainer.lr"
    if cfg.model.path is None and cfg.task.name in TASK_BASE_LR:
        return TASK_BASE_LR[cfg.task.name], f"the shipped {cfg.task.name} base's"
    if warmed_up:
        return WARMUP_BASE_LR, "a base the warm-up builds on the task (docs/recipe.md)"
    if cfg.model.path is None or params is None:
        return TINY_MODEL_LR, "the built-in tiny model's"
    if params < TINY_LR_MAX_PARAMS:
        return TINY_MODEL_LR, f"the tiny model's, for a loaded model of {params / 1e6:.1f} M parameters (under 10 M)"
    lo, hi = LOADED_LR_RANGE
    lr = min(hi, max(lo, LOADED_LR_REF * math.sqrt(1e8 / params)))
    lora = cfg.model.lora.enabled
    lr = float(f"{lr * (LORA_LR_FACTOR if lora else 1.0):.2g}")  # a number people can read back
    what = f"{params / 1e6:.0f} M parameters{', LoRA' if lora else ''}"
    return lr, f"the rule for a loaded model of {what} (docs/memory.md; set trainer.lr to choose)"


@dataclass(frozen=True)
class Sized:
    """A run's config with every need-dependent default resolved, and what was resolved how."""

    cfg: Config
    notes: tuple[str, ...]
    """One line per field resolved here, e.g. 'engine.max_seq_len: 11 (longest prompt 7 + ...)'."""
    seq_len: int
    """The run's longest sequence (run_seq_len), whatever engine.max_seq_len says: what trainers see."""


def _dtype_bytes(spec: str | None, device: str, field: str) -> int:
    """Bytes per element of `spec` as the actor resolves it (device.resolve_dtype): None and auto are
    asked of the actor's device here too; an explicit dtype needs no device."""
    if spec is None or spec == "auto":
        return resolve_dtype(spec, resolve_device(device, field.split(".")[0] + ".device"), field).itemsize
    return 4 if spec == "float32" else 2


def engine_dtype_bytes(cfg: Config) -> int:
    """Bytes per element of the built-in engine's weights and KV cache (dtype auto: bf16 on a GPU)."""
    return _dtype_bytes(cfg.engine.dtype, cfg.engine.device, "engine.dtype")


def trainer_dtype_bytes(cfg: Config) -> int:
    """Bytes per element of the trainer's autocast matmuls: 2 where `trainer.precision` resolves to
    bfloat16 (as the trainer resolves it, trainer/worker.py: None is float32), else 4 (no autocast)."""
    return _dtype_bytes(cfg.trainer.precision or "float32", cfg.trainer.device, "trainer.precision")


def wire_dtype(cfg: Config) -> str:
    """The dtype weights travel in (transport.dtype resolved): 'auto' is the built-in engine's dtype when
    the run sends full weights to engines on the host, otherwise float32 (LoRA adapters train in float32;
    vLLM reloads a float32 staging model; GPU paths are kept as measured)."""
    spec = cfg.transport.dtype
    if spec != "auto":
        return spec
    if cfg.engine.kind != "builtin" or cfg.model.lora.enabled:
        return "float32"
    device = resolve_device(cfg.engine.device, "engine.device")
    if device.type != "cpu":
        return "float32"
    return dtype_name(resolve_dtype(cfg.engine.dtype, device, "engine.dtype"))


def wire_bytes(cfg: Config) -> int:
    """Bytes per element of what the weight transport carries (`wire_dtype`)."""
    return 4 if wire_dtype(cfg) == "float32" else 2


def compile_off_reason(cfg: Config) -> str | None:
    """Why trainer.compile left None stays off for this loaded model (None: it goes on)."""
    if cfg.trainer.ranks > 1:
        return f"trainer.ranks {cfg.trainer.ranks}: DDP and FSDP2 hook the layers' own forward"
    if cfg.model.lora.enabled:
        return "model.lora: the adapters' layers run eager"
    return compile_blocker()


def size_run(cfg: Config, shape: ModelShape, longest_prompt: int, memory_total: int, warmed_up: bool = False) -> Sized:
    """`cfg` with engine.max_seq_len, engine.max_concurrent_seqs, engine.vllm.max_model_len and
    trainer.lr resolved for a run whose longest admitted prompt has `longest_prompt` tokens, on
    a machine of `memory_total` bytes (or run.memory_limit_gib); `warmed_up` as in `learning_rate`."""
    notes: list[str] = []
    seq_len = run_seq_len(cfg, longest_prompt, shape.max_positions)
    why = (
        f"env.max_episode_tokens {cfg.env.max_episode_tokens}"
        if cfg.env is not None
        else f"longest prompt {longest_prompt} + rollout.max_new_tokens {cfg.rollout.max_new_tokens}"
    )
    why += f", at most the model's {shape.max_positions} positions"
    engine = cfg.engine
    update: dict = {}
    trainer = cfg.trainer
    if cfg.model.path is not None and shape.params >= AUTO_BF16_MIN_PARAMS:  # docs/precision.md
        loaded = f"a loaded model of {shape.params / 1e6:.0f} M >= {AUTO_BF16_MIN_PARAMS / 1e6:.0f} M parameters"
        if engine.dtype is None:
            update["dtype"] = "auto"
            engine = engine.model_copy(update={"dtype": "auto"})
            notes.append(f"engine.dtype: auto ({loaded}: bfloat16 where the engine's device has it)")
        if trainer.precision is None:
            trainer = trainer.model_copy(update={"precision": "auto"})
            notes.append(f"trainer.precision: auto ({loaded}: bfloat16 autocast where the trainer's device has it)")
        if trainer.packed is None:
            trainer = trainer.model_copy(update={"packed": cfg.trainer.ranks == 1})
            notes.append(
                f"trainer.packed: true ({loaded}: the forward runs on real tokens, not rows x longest)"
                if cfg.trainer.ranks == 1
                else f"trainer.packed: false (trainer.ranks {cfg.trainer.ranks})"
            )
        if trainer.compile is None:
            why_not = compile_off_reason(cfg)
            trainer = trainer.model_copy(update={"compile": why_not is None})
            notes.append(
                f"trainer.compile: true ({loaded}: fused decoder layers; the first step pays the compile)"
                if why_not is None
                else f"trainer.compile: false ({why_not})"
            )
        if engine.kind == "vllm" and engine.vllm.dtype is None:  # as the built-in engine's auto resolves
            device = resolve_device(engine.device, "engine.device")
            dtype = dtype_name(resolve_dtype("auto", device, "engine.vllm.dtype"))
            engine = engine.model_copy(update={"vllm": engine.vllm.model_copy(update={"dtype": dtype})})
            update["vllm"] = engine.vllm
            notes.append(f"engine.vllm.dtype: {dtype} ({loaded}: bfloat16 where the engine's device has it)")
    if engine.max_seq_len is None:
        update["max_seq_len"] = seq_len
        notes.append(f"engine.max_seq_len: {seq_len} ({why})")
    vllm = engine.vllm
    if vllm.max_model_len is None:
        vllm = vllm.model_copy(update={"max_model_len": seq_len})
        if engine.kind == "vllm":
            notes.append(f"engine.vllm.max_model_len: {seq_len} ({why})")
    if engine.kind == "vllm" and vllm.kv_cache_gib is None and "memory_fraction" not in vllm.model_fields_set:
        gib = vllm_kv_gib(vllm.max_num_seqs, vllm.max_model_len or seq_len, shape, vllm.dtype)
        vllm = vllm.model_copy(update={"kv_cache_gib": gib})
        notes.append(
            f"engine.vllm.kv_cache_gib: {gib:g} (engine.vllm.max_num_seqs {vllm.max_num_seqs} x "
            f"{vllm.max_model_len} tokens, not a fraction of the machine)"
        )
    if vllm is not engine.vllm:
        update["vllm"] = vllm
    if engine.max_concurrent_seqs is None:
        memory = cfg.run.memory_limit_gib * GIB if cfg.run.memory_limit_gib is not None else memory_total
        per_token = shape.kv_bytes_per_token(engine_dtype_bytes(cfg.model_copy(update={"engine": engine})))
        budget = engine.kv_cache_fraction * memory / cfg.runtime.num_engines
        slots = engine_slots(engine.max_seq_len or seq_len, per_token, budget, cfg.rollout.group_size)
        update["max_concurrent_seqs"] = slots
        if engine.kind == "builtin":
            notes.append(
                f"engine.max_concurrent_seqs: {slots} (at most {DEFAULT_SLOTS}, within engine.kv_cache_fraction "
                f"{engine.kv_cache_fraction:g} of {memory / GIB:.1f} GiB over {cfg.runtime.num_engines} engine(s))"
            )
    lr, source = learning_rate(cfg, shape.params if cfg.model.path is not None else None, warmed_up)
    if trainer.lr is None:
        trainer = trainer.model_copy(update={"lr": lr})
        notes.append(f"trainer.lr: {lr:g} ({source})")
    if trainer.ranks == 1:
        whole = forward_tokens(cfg, shape, seq_len)[0]
        if trainer.micro_batch_tokens is None:
            memory = cfg.run.memory_limit_gib * GIB if cfg.run.memory_limit_gib is not None else memory_total
            budget, why = micro_batch_tokens(cfg.model_copy(update={"trainer": trainer}), shape, seq_len, memory)
            trainer = trainer.model_copy(update={"micro_batch_tokens": budget})
        else:
            budget, why = trainer.micro_batch_tokens, "set"
        parts = f"{math.ceil(whole / budget)} micro-batches of" if budget < whole else "one forward of"
        notes.append(f"trainer.micro_batch_tokens: {budget} ({why}; {parts} the batch's {whole:,} tokens at most)")
    resolved = cfg.model_copy(update={"engine": engine.model_copy(update=update), "trainer": trainer})
    return Sized(resolved, tuple(notes), seq_len)


LOADED_MAX_NEW_TOKENS = 256
"""rollout.max_new_tokens of a loaded model of >= AUTO_BF16_MIN_PARAMS parameters when unset. The
field's own default, 4, fits the built-in addition task's answers; a chat model answers in sentences
(SmolLM2-135M-Instruct: 14-52 tokens on one-digit arithmetic, some past 64) and stops at its end of
turn, so the cap only bounds the rambling tail."""
LOADED_EVAL_EVERY = 5
"""run.eval_every of such a model when unset: its steps take seconds to tens of seconds on a CPU, not
the tiny model's milliseconds, so every 25 steps would leave a 10-minute run with two evaluations.
run.max_time_s, whose default (190 s) is the tiny default job's RL budget, is lifted for such a model
when unset: it trains until run.max_steps or run.max_total_s."""


def loaded_model_defaults(cfg: Config, params: int) -> tuple[Config, tuple[str, ...]]:
    """`cfg` with rollout.max_new_tokens, run.eval_every and run.max_time_s resolved for a loaded model
    of `params` parameters, where the user left them unset (the built-in tiny model keeps the fields'
    defaults)."""
    if cfg.model.path is None or params < AUTO_BF16_MIN_PARAMS:
        return cfg, ()
    notes, why = [], f"a loaded model of {params / 1e6:.0f} M >= {AUTO_BF16_MIN_PARAMS / 1e6:.0f} M parameters"
    rollout, run = cfg.rollout, cfg.run
    if "max_new_tokens" not in rollout.model_fields_set:
        rollout = rollout.model_copy(update={"max_new_tokens": LOADED_MAX_NEW_TOKENS})
        notes.append(f"rollout.max_new_tokens: {LOADED_MAX_NEW_TOKENS} ({why}; set it to choose)")
    if "eval_every" not in run.model_fields_set:
        run = run.model_copy(update={"eval_every": LOADED_EVAL_EVERY})
        notes.append(f"run.eval_every: {LOADED_EVAL_EVERY} ({why})")
    if "max_time_s" not in run.model_fields_set:
        run = run.model_copy(update={"max_time_s": None})
        notes.append(
            f"run.max_time_s: none, the tiny default job's 190 s lifted ({why}; run.max_steps and "
            "run.max_total_s bound the run)"
        )
    return cfg.model_copy(update={"rollout": rollout, "run": run}), tuple(notes)
