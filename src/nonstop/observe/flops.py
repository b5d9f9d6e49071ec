"""Achieved FLOP/s: what a forward pass costs, and the machine's matmul peak to compare it with.

Contract (docs/precision.md has the formulas with an example):
- `FlopModel.of(model)` reads a causal LM's matmul sizes once: `body`, the weights every input
  token multiplies (every 2-D parameter but the input embedding table and the output head; a
  mixture-of-experts layer's fused expert tensors count k of E experts), `head` (hidden x vocab,
  paid only at the positions whose logits are computed), and the attention width
  (layers x query heads x head dim);
- `FlopModel.forward(tokens, logit_rows, attn_pairs)` = 2 x body x tokens + 2 x head x logit_rows
  + 4 x layers x heads x head_dim x attn_pairs, where attn_pairs counts (query, key) pairs a
  causal mask lets through (QK^T and AV are 2 FLOPs per multiply-add each). Norms, biases,
  activations and the softmax are left out: they are a few percent at any real shape;
- `causal_pairs(start, n)`: the pairs of n tokens at positions start..start+n-1 attending to
  every earlier position and themselves;
- `train_flops(fm, groups, shared_prompts, factor, shared_prefix)`: a trainer step over real
  (unpadded) tokens: the forward as the trainer runs it (each distinct prompt once when
  `shared_prompts`, and with `shared_prefix`, the packed forward's, the head the distinct prompts
  share once: `types.shared_prefix_len`, over the whole step, though each micro-batch computes its
  own; else prompt + completion per sample) times `factor` (3: forward + backward of activations and
  weights; 2 with LoRA, whose frozen base needs no weight gradients; + 1 for a KL reference);
- `matmul_peak(dtype, device, seconds)`: FLOP/s of a square matmul in `dtype` on this process's
  threads, the best of a few bursts over about `seconds`, once per (dtype, device, threads) and
  process; `PeakProbe` keeps a worker's best probe and probes again at exponentially spaced times;
- `FlopTally` (the orchestrator's): the engines' achieved FLOP/s between two reads of their
  cumulative counters (at evaluations and at most every `engines_every_s` between them), and
  whole-run figures for summary.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch

from nonstop.types import Group, shared_prefix_len

PROBE_SIZE = 1024
"""Side of the probe's square matmul: large enough that a CPU core's FLOP/s no longer grows with it
(within ~10% of 2048 here), small enough to repeat several times in a quarter of a second."""


@dataclass(frozen=True)
class FlopModel:
    body: int
    """Matmul weights per input token (decoder layers; MoE experts: the k of E a token uses)."""
    head: int
    """hidden x vocab of the output head."""
    attn_width: int
    """layers x query heads x head dim."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlopModel:
        config: Any = model.config
        embed = model.get_input_embeddings().weight  # type: ignore[operator]
        head = model.get_output_embeddings().weight  # type: ignore[operator]
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        active = getattr(config, "num_experts_per_tok", None)
        body = 0
        for p in model.parameters():  # tied weights appear once
            if p.dim() < 2 or p is embed or p is head:
                continue
            n = p.numel()
            if p.dim() == 3 and experts and active and p.shape[0] == experts:  # fused experts: k of E used
                n = n * active // experts
            body += n
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(body, head.numel(), config.num_hidden_layers * heads * head_dim)

    def forward(self, tokens: int, logit_rows: int, attn_pairs: int) -> int:
        return 2 * self.body * tokens + 2 * self.head * logit_rows + 4 * self.attn_width * attn_pairs


def causal_pairs(start: int, n: int) -> int:
    """Sum over positions start..start+n-1 of (position + 1)."""
    return n * start + n * (n + 1) // 2


def train_flops(
    fm: FlopModel, groups: list[Group], shared_prompts: bool, factor: int, shared_prefix: bool = False
) -> int:
    """FLOPs of one trainer step over `groups` (see the module docstring)."""
    tokens = rows = pairs = 0
    samples = [s for g in groups for s in g.samples]
    if shared_prompts:  # trainer/forward.py: each distinct prompt once, the packed forward's shared head once
        distinct = list(dict.fromkeys(tuple(s.prompt_ids) for s in samples))
        head = shared_prefix_len(distinct) if shared_prefix else 0
        tokens += head + sum(len(p) - head for p in distinct)
        pairs += causal_pairs(0, head) + sum(causal_pairs(head, len(p) - head) for p in distinct)
    for s in samples:
        P, C = len(s.prompt_ids), len(s.completion_ids)
        rows += C
        if shared_prompts:  # then each completion's inputs (all but its last token) after its prompt
            tokens += max(C - 1, 0)
            pairs += causal_pairs(P, max(C - 1, 0))
        else:
            tokens += P + C
            pairs += causal_pairs(0, P + C)
    return factor * fm.forward(tokens, rows, pairs)


PROBE_BURSTS = 5
"""Bursts per probe, the best kept."""


def _burst(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, seconds: float) -> float:
    """FLOP/s of back-to-back matmuls over about `seconds` (at least 3 of them)."""
    cuda = a.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        reps += 1
        if reps % 4 == 0 or not cuda:
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds and reps >= 3:
                return 2 * PROBE_SIZE**3 * reps / elapsed


def _measure(dtype: torch.dtype, device: str, seconds: float) -> float:
    """The best of PROBE_BURSTS bursts over about `seconds` in all: another process's work (an
    engine loading, a scorer) slows some bursts, and the machine's limit is what the fastest shows."""
    dev = torch.device(device)
    a = torch.randn(PROBE_SIZE, PROBE_SIZE, device=dev).to(dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE, device=dev).to(dtype)
    out = torch.empty(PROBE_SIZE, PROBE_SIZE, device=dev, dtype=dtype)
    torch.matmul(a, b, out=out)  # first call: kernel selection and page faults, not timed
    return max(_burst(a, b, out, seconds / PROBE_BURSTS) for _ in range(PROBE_BURSTS))


@cache
def _peak(dtype: torch.dtype, device: str, threads: int, seconds: float) -> float:
    return _measure(dtype, device, seconds)


def matmul_peak(dtype: torch.dtype, device: torch.device, seconds: float = 0.25) -> float:
    """FLOP/s of this process's matmuls in `dtype` (see the module docstring)."""
    return _peak(dtype, str(device), torch.get_num_threads(), seconds)


class PeakProbe:
    """A worker's matmul peak, kept as the best probe so far. The first probe runs while the run
    starts (other actors load their models on the same cores) and can read low, which would put
    achieved FLOP/s above 100% of it. `tick()` (after a trainer step, at an engine's stats) probes
    again for about `refresh_s` once `first_refresh_s`, then twice, four times, ... that long has
    passed since the first probe: a quieter moment can still raise the peak, at a cost of at most
    refresh_s / first_refresh_s (1%) of the run, shrinking as it goes."""

    def __init__(
        self, dtype: torch.dtype, device: torch.device, refresh_s: float = 0.05, first_refresh_s: float = 5.0
    ) -> None:
        self.dtype, self.device, self.refresh_s = dtype, str(device), refresh_s
        self.best = matmul_peak(dtype, device)
        self.start, self.next_s = time.perf_counter(), first_refresh_s

    def tick(self) -> float:
        """Probe again when due (see the class docstring). Returns the best peak so far."""
        if time.perf_counter() - self.start >= self.next_s:
            self.best = max(self.best, _measure(self.dtype, self.device, self.refresh_s))
            self.next_s *= 2
        return self.best


def rate(flops: float, seconds: float, peak: float) -> tuple[float, float]:
    """(achieved FLOP/s, fraction of `peak`); zeros where nothing was timed."""
    if seconds <= 0 or peak <= 0:
        return 0.0, 0.0
    achieved = flops / seconds
    return achieved, achieved / peak


@dataclass
class FlopTally:
    """Achieved FLOP/s over a run, from the trainer's step metrics (`flops`, `flops_per_s`,
    `peak_flops_per_s`) and the engines' cumulative stats (`flops`, `busy_s`, `peak_flops_per_s`).
    Engines: the sum of FLOPs over the sum of busy seconds, and over the sum of busy seconds x each
    engine's peak; a restarted engine's counters start again from 0, its new totals then count
    whole. A resumed run counts from the resume."""

    engine_last: list[tuple[float, float]] = field(default_factory=list)
    trainer: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # flops, seconds, seconds x peak
    engines_every_s: float = 5.0
    """Seconds between two reads of the engines' counters outside evaluations: a read is a round
    trip to every engine, which a step of a few milliseconds should not pay each time."""
    engines_read_at: float = float("-inf")

    def engines_due(self, t: float) -> bool:
        """Whether the engines' counters are due a read at time `t` (seconds); counts it as read."""
        if t - self.engines_read_at < self.engines_every_s:
            return False
        self.engines_read_at = t
        return True

    def engines(self, stats: list[dict[str, Any]]) -> tuple[float | None, float | None]:
        """(achieved FLOP/s, fraction of peak) of the engines since the last call; None: no counts
        (vLLM engines count no FLOPs)."""
        if not stats or any("flops" not in st for st in stats):
            return None, None
        flops = busy = weighted = 0.0
        for i, st in enumerate(stats):
            f, b = float(st["flops"]), float(st["busy_s"])
            f0, b0 = self.engine_last[i] if i < len(self.engine_last) else (0.0, 0.0)
            df, db = (f - f0, b - b0) if f >= f0 and b >= b0 else (f, b)
            flops, busy, weighted = flops + df, busy + db, weighted + db * float(st["peak_flops_per_s"])
        self.engine_last = [(float(st["flops"]), float(st["busy_s"])) for st in stats]
        return (flops / busy, flops / weighted) if busy > 0 and weighted > 0 else (0.0, 0.0)

    def trainer_step(self, metrics: dict[str, Any]) -> None:
        if metrics.get("flops_per_s"):
            secs = metrics["flops"] / metrics["flops_per_s"]
            self.trainer = [
                self.trainer[0] + metrics["flops"],
                self.trainer[1] + secs,
                self.trainer[2] + secs * metrics["peak_flops_per_s"],
            ]

    def summary(self, engine_stats: list[dict[str, Any]]) -> dict[str, float | None]:
        """Whole-run figures: the trainer's over its steps, the engines' from their final counters."""
        achieved, frac = FlopTally().engines(engine_stats)
        f, t, w = self.trainer
        return {
            "trainer_flops_per_s": f / t if t > 0 else None,
            "trainer_peak_frac": f / w if w > 0 else None,
            "engine_flops_per_s": achieved,
            "engine_peak_frac": frac,
        }
