"""The preflight memory plan: what each process of a run will hold, from config.json alone.

`plan_memory(cfg, shape, machine)` takes a config whose need-dependent defaults are resolved
(sizing/defaults.py) and the policy's `ModelShape`, and returns a `MemoryPlan`: per process kind
(one engine, one trainer rank, the orchestrator, shared memory) its items in bytes, each with
the formula it came from and the fields that change it. Figures (docs/memory.md):

- engine (built-in): weights (params x engine dtype), the KV cache (slots x max_seq_len x layers
  x 2 x KV heads x head dim x dtype: exactly what the runner allocates), a float32 staging copy
  of the weights where the update mode applies versions later or the engine is not float32,
  the transport's receive buffers (broadcast: 2 flat copies, files: 1, 2 with notify http);
- engine (vLLM): its reservation (kv_cache_gib + weights, else memory_fraction x the machine's
  memory), the float32 staging model it receives into, receive buffers, two runtimes (the actor
  and vLLM's engine core);
- trainer rank: float32 weights, gradients and AdamW's two float32 states of what it trains (all
  weights, or the LoRA adapters; fsdp2 shards the three over the ranks), the parameter-sized
  temporaries of torch's foreach AdamW step, DDP's gradient buckets,
  a KL reference or distillation teacher, and activations (an estimate, for the largest forward
  the trainer runs at once: the whole batch, or one micro-batch of trainer.micro_batch_tokens;
  per token and per layer 6 x hidden + 2 x KV width + 4 x MLP width float32 values kept for
  backward (two norms' inputs and outputs, q, the attention output, k, v; the MLP's gate, up,
  SiLU and product), or with trainer.activation_checkpointing one hidden vector per layer plus
  one layer's values; plus one chunk of the completion tokens' logits over the vocabulary, which
  the log-prob recomputes in the backward (with an entropy bonus every chunk's float32 log-probs
  are kept instead));
- shm transport: N + 2 slots of the sent weights in /dev/shm, charged once to the machine;
- every process: RUNTIME_BYTES for Python, torch and transformers (246 MiB measured); the
  orchestrator ORCHESTRATOR_BYTES (360 MiB measured with the default task);
- every process that holds a model, and the orchestrator: a headroom of run.memory_headroom (0.3)
  x its estimated items (ESTIMATED: activations, temporaries, logits, the runtime), for the
  allocator's fragmentation and the temporaries the estimates leave out.

Items on a GPU are listed but not counted against the host. `MemoryPlan.check()` raises a
ConfigError naming the field to change when the host total exceeds what the run may use
(run.memory_limit_gib, else the machine's available memory).
"""

from __future__ import annotations

from pathlib import Path

import torch

from nonstop.config import Config
from nonstop.config.kinds import device_path_of
from nonstop.sizing.defaults import (
    engine_dtype_bytes,
    forward_tokens,
    micro_batch,
    trainer_dtype_bytes,
    vllm_dtype,
    wire_bytes,
)
from nonstop.sizing.machine import GIB, MachineMemory, size
from nonstop.sizing.plan import MemoryPlan, Proc
from nonstop.sizing.shape import ModelShape
from nonstop.trainer.logprobs import HEAD_CHUNK_POSITIONS

RUNTIME_BYTES = 300 * 1024**2
"""One process's Python + torch + transformers (246 MiB RSS measured), rounded up."""
ORCHESTRATOR_BYTES = 400 * 1024**2
"""The orchestrator: a runtime plus the task's rows, the tokenizer and the pipeline's state."""
VLLM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _on_gpu(spec: str) -> bool:
    """Where a device setting puts a process (an impossible one fails in the actor, naming its field)."""
    if spec == "auto":
        return torch.cuda.is_available()
    return spec.startswith("cuda")


def _receive_buffers(cfg: Config, sent: int) -> tuple[int, str]:
    kind = cfg.transport.kind
    if kind == "broadcast":
        return 2 * sent, "2 flat copies (ready, receiving)"
    if kind == "files":
        copies = 2 if getattr(cfg.transport, "notify", "marker") == "http" else 1
        return copies * sent, f"{copies} loaded version(s)"
    return 0, ""


SMALLER = ("model.path", "use a smaller model")


def _engine(cfg: Config, shape: ModelShape, name: str, count: int, sent: int, machine_total: int, merges: bool) -> Proc:
    """`merges`: the engine receives LoRA adapters and merges them into a kept copy of the base."""
    p, e, params = Proc(name, count), cfg.engine, shape.params
    fewer = ("runtime.num_engines", "lower runtime.num_engines") if count > 1 else SMALLER
    recv, how = _receive_buffers(cfg, sent)
    adapters = ("model.lora.enabled", "set model.lora.enabled=true (only the adapters travel)")
    base = shape.lora_base_params(cfg.model.lora.target_modules) if merges else 0
    targets = ("model.lora.target_modules", "target fewer modules (model.lora.target_modules)")
    if e.kind == "vllm":
        v = e.vllm
        vb = vllm_dtype(v.dtype, shape)
        weights = params * VLLM_BYTES.get(vb, 4)
        if v.kv_cache_gib is not None:
            p.add(
                "vllm reserve",
                weights + v.kv_cache_gib * GIB,
                f"weights + kv_cache_gib {v.kv_cache_gib:g}",
                "engine.vllm.kv_cache_gib",
                "lower engine.vllm.kv_cache_gib",
            )
        else:
            p.add(
                "vllm reserve",
                max(weights, v.memory_fraction * machine_total),
                f"memory_fraction {v.memory_fraction:g} x {size(machine_total)}",
                "engine.vllm.memory_fraction",
                "lower engine.vllm.memory_fraction",
            )
        if not _on_gpu(e.device):
            # measured at the 0.5B shape: the engine peaked 1.3 GiB over a plan without this item
            p.add(
                "packed copy",
                weights,
                f"vLLM's CPU backend packs the linear layers' weights for oneDNN ({vb}); a reload holds the loaded "
                "and the packed copy at once",
                "engine.vllm.dtype",
                "use engine.vllm.dtype bfloat16 where the CPU has it",
            )
        p.add("staging", params * 4, f"{params:,} params x 4 bytes (the float32 model vLLM reloads from)", *fewer)
        if merges:
            p.add("adapter base", base * 4, f"a float32 copy of the {base:,} targeted params, merged into", *targets)
        p.add("transport", recv, how, *adapters)
        p.add("runtime", 2 * RUNTIME_BYTES, "the actor + vLLM's engine core", *fewer)
        return p
    gpu = _on_gpu(e.device)
    eb = engine_dtype_bytes(cfg)
    slots, seq = e.max_concurrent_seqs or 1, e.max_seq_len or shape.max_positions
    p.add("weights", params * eb, f"{params:,} params x {eb} bytes", *fewer, on_host=not gpu)
    p.add(
        "kv_cache",
        slots * seq * shape.kv_bytes_per_token(eb),
        f"{slots} seqs x {seq} tokens x {shape.kv_formula(eb)}",
        "engine.max_concurrent_seqs",
        "lower engine.max_concurrent_seqs or engine.max_seq_len",
        on_host=not gpu,
    )
    # one pass's logits in the weights' dtype, their float32 copy (none when they are float32) and
    # its log-softmax; sampling's probabilities reuse the copy. Measured at the 0.5B shape in bf16:
    # decoding 16 rows took 26 MiB above the weights and cache, 64 rows 98 MiB (this item: 23 and 93)
    copy = 4 if eb != 4 else 0
    p.add(
        "logits",
        slots * shape.vocab * (eb + copy + 4),
        f"{slots} rows x {shape.vocab} x ({eb} + {copy} + 4) bytes: one pass's logits, a float32 copy of them "
        "and their log-probs",
        "engine.max_concurrent_seqs",
        "lower engine.max_concurrent_seqs",
        on_host=not gpu,
    )
    cached = e.prefix_cache_tokens if e.prefix_cache_tokens is not None else slots * seq // 8
    if cached:
        p.add(
            "prefix cache",
            cached * shape.kv_bytes_per_token(eb),
            f"{cached:,} tokens x {shape.kv_formula(eb)}: prompt prefixes kept across groups",
            "engine.prefix_cache_tokens",
            "lower engine.prefix_cache_tokens (0: off)",
            on_host=not gpu,
        )
    if not gpu:
        # decode attention's temporaries, one layer at a time: torch's CPU kernel, given a mask, copies
        # every row's cached keys and values and expands them to the query heads (engine/runner.py), and
        # the engine keeps its freed memory (device.retain_freed_memory). Measured on SmolLM2-135M in
        # bf16 at 256 slots: 330 MiB above the weights, cache and runtime at 107 positions, 634 MiB at
        # 299, i.e. 11 bytes per slot x position x query-head dimension (this item: 12)
        p.add(
            "attention temporaries",
            slots * seq * shape.heads * shape.head_dim * 12,
            f"{slots} rows x {seq} positions x {shape.heads} heads x {shape.head_dim} x 12 bytes: one layer's keys "
            "and values expanded to the query heads, and its scores",
            "engine.max_concurrent_seqs",
            "lower engine.max_concurrent_seqs or engine.max_seq_len",
        )
    if merges:  # the adapters are merged into the live weights, or into a staging copy in their dtype
        p.add("adapter base", base * eb, f"a copy of the {base:,} targeted params x {eb} bytes, merged into", *targets)
    wb = eb if merges else wire_bytes(cfg)
    if e.update_mode != "never_stop" or eb != wb or gpu:
        p.add(
            "staging",
            params * wb,
            f"{wb}-byte copy it receives into: update_mode {e.update_mode}, {eb}-byte weights",
            "engine.update_mode",
            "use engine.update_mode never_stop",
            on_host=not gpu or device_path_of(cfg.transport) == "host",
        )
    p.add("transport", recv, how, *adapters)
    p.add("runtime", RUNTIME_BYTES, "Python, torch, transformers", *fewer)
    return p


def _trainer(
    cfg: Config, shape: ModelShape, name: str, trained: int, extra: list[tuple[str, int, str, str]], seq: int
) -> Proc:
    t = cfg.trainer
    ranks = t.ranks
    p, gpu, params = Proc(name, ranks), _on_gpu(t.device), shape.params
    shard = ranks if ranks > 1 and t.data_parallel == "fsdp2" else 1
    per = f" / {shard} ranks (fsdp2)" if shard > 1 else ""
    what = "adapter " if cfg.model.lora.enabled else ""
    lora = ("model.lora.enabled", "set model.lora.enabled=true (only adapters get gradients and optimizer state)")
    p.add("weights", params * 4 / shard, f"{params:,} params x 4 bytes{per}", *SMALLER, on_host=not gpu)
    p.add("grads", trained * 4 / shard, f"{trained:,} {what}params x 4 bytes{per}", *lora, on_host=not gpu)
    p.add(
        "optimizer",
        trained * 8 / shard,
        f"AdamW: 2 states x {trained:,} {what}params x 4 bytes{per}",
        *lora,
        on_host=not gpu,
    )
    # torch's foreach AdamW (fsdp2's sharded parameters) makes parameter-sized temporaries in each
    # step: without this item a 104 M-parameter trainer peaked 0.34 GiB above its plan. The fused
    # step of every other trainer makes none (measured), but the heap the trainer keeps
    # (device.retain_freed_memory) fragments by about as much: the 0.5B trainer measured at its
    # plan with the item (docs/memory.md)
    how = "AdamW foreach" if shard > 1 else "the kept heap's fragmentation (fused AdamW makes no temporaries)"
    p.add("step temporaries", trained * 4 / shard, f"{how}: 1 x {trained:,} x 4 bytes{per}", *lora, on_host=not gpu)
    tb = trainer_dtype_bytes(cfg)
    if tb < 4:  # measured: a bf16 trainer of the 0.5B shape peaked 1.5 GiB over a plan without it
        head = shape.vocab * shape.hidden
        p.add(
            "autocast copies",
            (params + head) * tb / shard,
            f"({params:,} params + the head's {head:,}) x {tb} bytes: autocast's copies of the weights, kept for "
            f"backward, and the head's gradient before its cast to float32{per}",
            "trainer.precision",
            "set trainer.precision=float32",
            on_host=not gpu,
        )
    if shape.tied and not cfg.model.lora.enabled:
        p.add(
            "embedding gradient",
            shape.vocab * shape.hidden * 4 / shard,
            f"tied embeddings: the input embedding's {shape.vocab} x {shape.hidden} gradient, made dense before it is "
            f"added to the head's, x 4 bytes{per}",
            *SMALLER,
            on_host=not gpu,
        )
    if ranks > 1 and t.data_parallel == "ddp":
        p.add(
            "ddp buckets",
            trained * 4,
            "a copy of the gradients",
            "trainer.ranks",
            "lower trainer.ranks",
            on_host=not gpu,
        )
    for item, nbytes, detail, fld in extra:
        p.add(item, nbytes, detail, fld, f"change {fld}", on_host=not gpu)
    tokens, rows, new = micro_batch(cfg, shape, seq)
    ckpt = t.activation_checkpointing
    kept = shape.activation_bytes_per_token(ckpt)
    layers = (
        f"({shape.layers} layers x {shape.hidden} + 1 layer x {shape.layer_activation_values()})"
        if ckpt
        else f"{shape.layers} layers x {shape.layer_activation_values()}"
    )
    chunk = min(rows, t.logprob_chunk_rows)
    if t.entropy_coef > 0:  # every chunk's float32 log-softmax and probabilities stay; one chunk's logits and grads
        logit_rows, logit_bytes, what = rows * 2 + 2 * chunk, 4, "log-probs"
    else:  # one chunk's logits at a time (logprobs.head_logprobs recomputes them in the backward): the
        # chunk's logits, their gradient and the matmuls' operands on the way (d weight is summed in
        # place, in the autocast copy's dtype: the autocast copies item counts it); a chunk is
        # chunk rows x completion positions, at most HEAD_CHUNK_POSITIONS
        logit_rows, logit_bytes, what = 3, tb, "logits"
        new = min(chunk * new, HEAD_CHUNK_POSITIONS)
    per = "micro-batch" if tokens < forward_tokens(cfg, shape, seq)[0] else "batch"
    p.add(
        "activations",
        tokens * kept + logit_rows * new * shape.vocab * logit_bytes,
        f"estimate: {tokens} tokens of one {per} (trainer.micro_batch_tokens) x {layers} float32 values"
        f"{' (activation checkpointing)' if ckpt else ''} "
        f"+ {logit_rows} x {new} x {shape.vocab} {what} x {logit_bytes} bytes",
        "trainer.micro_batch_tokens",
        "lower trainer.micro_batch_tokens or set trainer.activation_checkpointing=true",
        on_host=not gpu,
    )
    p.add("runtime", RUNTIME_BYTES, "Python, torch, transformers", *SMALLER)
    return p


ESTIMATED = ("activations", "attention temporaries", "logits", "runtime")
"""The items that are estimates, not counts of what is allocated (weights, states, caches and
buffers are counted exactly): the headroom is a fraction of these."""


def _add_headroom(proc: Proc, fraction: float) -> None:
    """The stated headroom of a process: `fraction` of its estimated items on the host."""
    estimated = [i for i in proc.items if i.on_host and i.name in ESTIMATED]
    total = sum(i.bytes for i in estimated)
    proc.add(
        "headroom",
        total * fraction,
        f"{fraction:g} x the {size(total)} of estimates ({', '.join(i.name for i in estimated)}): the "
        "allocator's fragmentation and temporaries they leave out",
        "run.memory_headroom",
        "lower run.memory_headroom if you measured the run's processes below their plan",
    )


def plan_memory(
    cfg: Config,
    shape: ModelShape,
    machine: MachineMemory,
    notes: tuple[str, ...] = (),
    folder_of=None,
    seq_len: int | None = None,
) -> MemoryPlan:
    """The plan of a run whose need-dependent defaults `cfg` already holds (sizing/defaults.py).
    `folder_of(path, field)` turns a teacher / reward model / role path into a folder with a
    config.json (preflight.resolve_model_path); None reads the paths as they are. `seq_len`: the
    run's longest sequence (sizing.run_seq_len), which bounds what trainers see; None:
    engine.max_seq_len, else the model's positions."""
    seq = seq_len or cfg.engine.max_seq_len or shape.max_positions
    folder_of = folder_of or (lambda path, _field: Path(path))
    lora = cfg.model.lora
    trained = shape.lora_params(lora.rank, lora.target_modules) if lora.enabled else shape.params
    sent = trained * wire_bytes(cfg)  # what the transport carries: full weights in its dtype, or the adapters
    extra: list[tuple[str, int, str, str]] = []
    if cfg.trainer.kl_coef > 0:
        extra.append(("reference", shape.params * 4, f"{shape.params:,} params x 4 bytes", "trainer.kl_coef"))
    if cfg.distill.teacher is not None:
        teacher = ModelShape.from_folder(folder_of(cfg.distill.teacher, "distill.teacher")).params
        extra.append(("teacher", teacher * 4, f"{teacher:,} params x 4 bytes", "distill.teacher"))
    procs = [
        _engine(cfg, shape, "engine", cfg.runtime.num_engines, sent, machine.total, lora.enabled),
        _trainer(cfg, shape, "trainer", trained, extra, seq),
    ]
    segments = [("shm segment", cfg.runtime.num_engines)]
    for role, own in cfg.env.policies.items() if cfg.env is not None else ():
        role_shape = ModelShape.from_folder(folder_of(own.path, f"env.policies.{role}.path")) if own.path else shape
        role_sent = (
            role_shape.lora_params(lora.rank, lora.target_modules)
            if own.trains_lora(lora.enabled)
            else role_shape.params
        ) * 4
        merges = own.trains_lora(lora.enabled)
        procs.append(_engine(cfg, role_shape, f"{role}-engine", own.num_engines, role_sent, machine.total, merges))
        procs.append(_trainer(cfg, role_shape, f"{role}-trainer", role_sent // 4, [], seq))
        segments.append((f"{role} shm segment", own.num_engines))
    if cfg.scoring.reward_model is not None:
        rm = ModelShape.from_folder(folder_of(cfg.scoring.reward_model.path, "scoring.reward_model.path"))
        scorer = Proc("reward-model", 1)
        rm_field = ("scoring.reward_model.path", "use a smaller reward model")
        scorer.add(
            "weights", (rm.params - (0 if rm.tied else rm.vocab * rm.hidden)) * 4, "float32, no lm_head", *rm_field
        )
        scorer.add("runtime", RUNTIME_BYTES, "Python, torch, transformers", *rm_field)
        procs.append(scorer)
    for proc in procs:  # every process that holds a model: engines, trainers, a reward model
        _add_headroom(proc, cfg.run.memory_headroom)
    orchestrator = Proc("orchestrator", 1)
    # 360 MiB measured with the default task's 10,000 rows; 430 MiB under vLLM's environment (0.5B shape)
    vllm_env = 100 * 1024**2 if cfg.engine.kind == "vllm" else 0
    orchestrator.add("runtime", ORCHESTRATOR_BYTES + vllm_env, "Python, torch, transformers, the task's rows", *SMALLER)
    # its runtime is an estimate too: 420 MiB measured with SmolLM2's tokenizer and 256 completions of
    # up to 512 tokens in flight
    _add_headroom(orchestrator, cfg.run.memory_headroom)
    procs.append(orchestrator)
    if cfg.transport.kind == "shm":
        for seg_name, engines in segments:
            seg = Proc(seg_name, 1)
            fewer = (
                ("runtime.num_engines", "lower runtime.num_engines")
                if engines > 1
                else ("model.lora.enabled", "set model.lora.enabled=true (only the adapters travel)")
            )
            seg.add("slots", (engines + 2) * sent, f"({engines} engines + 2) slots x {size(sent)} sent", *fewer)
            procs.append(seg)
    if cfg.run.memory_limit_gib is not None:
        limit, source = int(cfg.run.memory_limit_gib * GIB), "run.memory_limit_gib"
    else:
        limit, source = machine.available, f"the machine's available memory, {machine.source}"
    return MemoryPlan(procs, limit, source, notes)
