"""bf16 vs float32 on this CPU: a trainer step and an engine decode at a ~50 M-parameter Qwen2 shape.

The model is a random Qwen2 (hidden 640, 10 layers, 10 heads, 2 KV heads, MLP 2048, the char
vocabulary of 128 entries, tied embeddings: about 50 M parameters). The same batch is used in
both dtypes:
- trainer: `Trainer.step` on `--prompts` groups of `--group` samples, each with a prompt of
  `--prompt-len` tokens and `--new` completion tokens. It runs in float32 and again under
  torch.autocast(bfloat16) with float32 master weights, as trainer.precision does. The worker's
  counts give the FLOPs of each step (observe/flops.py), and the peak is `matmul_peak` in the
  step's dtype on the same threads. One warm-up step, then the median of `--steps` steps;
- engine: `TorchEngine.generate` of `--prompts` x `--group` sequences of `--new` tokens, with the
  weights and KV cache in each dtype. Tokens/s is the median of `--rounds` rounds after a warm-up.
Without native bf16 (device.bf16_supported), the bf16 figures are those of torch's emulation.
The bench says so and still runs.
Run: python bench/precision.py [--threads 1] [--steps 2] [--quick]
Last line: RESULT bf16_step_speedup=<x> bf16_decode_speedup=<y> trainer_peak_frac=<f32 step's fraction>
bf16_trainer_peak_frac=<bf16 step's fraction>.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from nonstop.config import EngineConfig, TinyModelConfig, TrainerConfig
from nonstop.device import bf16_supported
from nonstop.engine.core import TorchEngine
from nonstop.models.tiny import make_tiny_model
from nonstop.observe.flops import FlopModel, matmul_peak, train_flops
from nonstop.trainer.core import Trainer
from nonstop.types import GenerationRequest, Group, Sample, SamplingParams

SHAPE = TinyModelConfig(
    hidden_size=640, num_layers=10, num_heads=10, num_kv_heads=2, intermediate_size=2048, max_position_embeddings=256
)


def batch(prompts: int, group: int, prompt_len: int, new: int) -> list[Group]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(prompts):
        prompt = torch.randint(3, 128, (prompt_len,), generator=g).tolist()
        samples = []
        for j in range(group):
            completion = torch.randint(3, 128, (new,), generator=g).tolist()
            samples.append(Sample(prompt, completion, [-4.0] * new, [0] * new, "length", [True] * new, reward=float(j)))
        out.append(Group(i, "p", "a", samples))
    return out


def trainer_step_s(dtype: torch.dtype, groups: list[Group], steps: int) -> tuple[float, float]:
    """(median step seconds, FLOPs of one step)."""
    model = make_tiny_model(SHAPE, seed=0)
    trainer = Trainer(model, TrainerConfig(lr=1e-6, correction="tis"), 1.0, 0)
    ctx = torch.autocast("cpu", dtype=dtype) if dtype != torch.float32 else contextlib.nullcontext()
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with ctx:
            trainer.step(groups)
        if i > 0:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - t0)
    return statistics.median(times), train_flops(FlopModel.of(model), groups, trainer.shared_prompts, 3)


def decode_tokens_per_s(dtype: torch.dtype, prompts: int, group: int, prompt_len: int, new: int, rounds: int) -> float:
    model = make_tiny_model(SHAPE, seed=0)
    torch.nn.Module.to(model, dtype)  # transformers wraps .to with a signature mypy cannot read
    settings = EngineConfig(max_concurrent_seqs=prompts * group, max_seq_len=prompt_len + new, dtype="float32")
    engine = TorchEngine(model, [-1], 0, settings=settings)  # no EOS: every sequence decodes `new` tokens
    reqs = [GenerationRequest(i, list(range(3, 3 + prompt_len)), group, SamplingParams(new)) for i in range(prompts)]
    rates = []
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        out = engine.generate(reqs)
        tokens = sum(len(s.completion_ids) for g in out for s in g)
        if r > 0:
            rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 timed step and round, 16 new tokens")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.rounds, a.new = 1, 1, 16
    torch.set_num_threads(a.threads)
    native = bf16_supported(torch.device("cpu"))
    params = sum(p.numel() for p in make_tiny_model(SHAPE).parameters())
    print(f"shape: {params / 1e6:.1f} M params, {a.threads} thread(s); native bf16 on this CPU: {native}")
    groups = batch(a.prompts, a.group, a.prompt_len, a.new)
    figures = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peak = matmul_peak(dtype, torch.device("cpu"), seconds=0.3)
        step_s, flops = trainer_step_s(dtype, groups, a.steps)
        tps = decode_tokens_per_s(dtype, a.prompts, a.group, a.prompt_len, a.new, a.rounds)
        frac = flops / step_s / peak
        figures[name] = (step_s, tps, frac)
        print(
            f"{name}: matmul peak {peak / 1e9:.0f} GFLOP/s; trainer step {step_s:.2f} s "
            f"({flops / step_s / 1e9:.0f} GFLOP/s, {frac:.0%} of peak); engine decode {tps:.0f} tokens/s"
        )
    step_x = figures["fp32"][0] / figures["bf16"][0]
    decode_x = figures["bf16"][1] / figures["fp32"][1]
    print(
        f"RESULT bf16_step_speedup={step_x:.2f} bf16_decode_speedup={decode_x:.2f} "
        f"trainer_peak_frac={figures['fp32'][2]:.3f} bf16_trainer_peak_frac={figures['bf16'][2]:.3f}"
    )


if __name__ == "__main__":
    main()
