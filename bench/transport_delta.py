"""Weights sent as deltas on a real model (`python bench/transport.py --model DIR`, issue 52).

A real RL loop on the model in DIR (SmolLM2-135M-Instruct in the repository's cache): the built-in
engine (one thread, the wire dtype) samples `group` completions of chat prompts "What is a+b?",
rewarded by how close its last number is to the sum; the trainer actor's own code (TrainerWorker, precision
'auto', trainer.lr at what sizing/defaults.py's rule resolves for the model) takes one step on them; the new
version then goes out through three publishers side by side:

- files with deltas (`transport.delta`), read by the engine itself before it samples the next batch;
- broadcast with deltas and checksums, to an engine process that reports the CRC32 of every version it
  rebuilt;
- files without deltas (the full version each time, nobody reads it): the reference of publish time.

Weights travel in the engine's dtype (`transport.dtype` 'auto': bfloat16 where this CPU has it). The
first publish carries the full version (no receiver holds a base); the next `steps` are the measured
ones. Per version the CRC32 of both engines is compared with the trainer's own weights cast to the wire
dtype.

RESULT keys: delta_bytes_frac (broadcast: the mean over the measured versions of the bytes sent over the
full version's), files_delta_bytes_frac (the same for the files publisher, full files of `full_every`
included), first_full_included (delta_bytes_frac with the first, full, publish counted in), crc_equal
(versions whose CRC matched on both engines / versions), lr, changed_frac (mean fraction of words
changed), publish_s_delta and publish_s_full (median seconds of a files publish with and without deltas).
"""

from __future__ import annotations

import multiprocessing as mp
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


def _report_versions(handle, model_dir: str, dtype: str, last: int, queue) -> None:
    """The broadcast engine: rank 1, every version applied as it comes, its CRC32 reported."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_receiver
    from nonstop.transport.base import receiver_crc32

    model = load_model(model_dir, getattr(torch, dtype))
    receiver = open_receiver(handle, model, 1)
    queue.put(("attached", None))
    while True:
        v = receiver.maybe_update(model)
        if v is not None:
            queue.put(("version", (v, receiver_crc32(receiver))))
            if v >= last:
                receiver.close()
                return
        time.sleep(0.002)


def closeness(text: str, answer: int) -> float:
    """1 for the right sum as the completion's last number, less the further off it is, 0 without a number:
    this model rarely gets two-digit sums right, and groups of equal rewards would teach nothing."""
    numbers = re.findall(r"\d+", text)
    return max(0.0, 1.0 - abs(int(numbers[-1]) - answer) / answer) if numbers else 0.0


def _batch(engine, tok, rng: random.Random, prompts: int, group: int, tokens: int, seed: int):
    from nonstop.types import GenerationRequest, Group, SamplingParams

    groups = []
    for i in range(prompts):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        ids = tok.apply_chat_template([{"role": "user", "content": f"What is {a}+{b}?"}], add_generation_prompt=True)
        ids = ids if isinstance(ids, list) else ids["input_ids"]
        samples = engine.generate([GenerationRequest(i, ids, group, SamplingParams(tokens, 1.0, seed=seed + i))])[0]
        for s in samples:
            s.reward = closeness(tok.decode(s.completion_ids), a + b)
        groups.append(Group(i, f"{a}+{b}", str(a + b), samples))
    return groups


@dataclass
class Measured:
    """Per publish: bytes sent over the full version's (broadcast and files with deltas), seconds of the
    files publishes with and without deltas, whether both engines' CRC matched, words changed."""

    lr: float
    wire: str
    precision: str
    broadcast: list[float] = field(default_factory=list)
    files: list[float] = field(default_factory=list)
    files_s: list[float] = field(default_factory=list)
    full_s: list[float] = field(default_factory=list)
    crc: list[bool] = field(default_factory=list)
    changed: list[float] = field(default_factory=list)
    full_mib: float = 0.0


def measure(model_dir: Path, steps: int, prompts: int, group: int, tokens: int) -> Measured:
    from transformers import AutoTokenizer

    from nonstop.config import (
        BroadcastTransportConfig,
        Config,
        EngineConfig,
        FilesTransportConfig,
        TrainerConfig,
    )
    from nonstop.device import dtype_name, resolve_dtype
    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model
    from nonstop.sizing.defaults import learning_rate
    from nonstop.sizing.shape import ModelShape
    from nonstop.trainer.worker import TrainerWorker
    from nonstop.transport import open_publisher, open_receiver, plan_transport
    from nonstop.transport.base import receiver_crc32, weights_crc32
    from nonstop.transport.delta import diff, word_dtype

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    wire = resolve_dtype("auto", torch.device("cpu"), "engine.dtype")
    lr, _ = learning_rate(
        Config.model_validate({"model": {"path": str(model_dir)}}), ModelShape.from_folder(model_dir).params
    )
    worker = TrainerWorker(str(model_dir), TrainerConfig.model_validate({"precision": "auto", "lr": lr}), 1.0, 2)
    model = worker.trainer.model
    dt = dtype_name(wire)
    run = Measured(lr, dt, dtype_name(worker.dtype))
    with tempfile.TemporaryDirectory(prefix="nonstop-delta-") as tmp:
        common = {"dtype": dt, "checksum": True}
        files_h = plan_transport(
            FilesTransportConfig.model_validate({**common, "dir": f"{tmp}/d", "delta": True}), model, 1
        )
        full_h = plan_transport(FilesTransportConfig.model_validate({**common, "dir": f"{tmp}/f"}), model, 1)
        bc = BroadcastTransportConfig.model_validate({**common, "delta": True, "timeout_s": 300})
        bc_h = plan_transport(bc, model, 1)
        publishers = {
            "files": open_publisher(files_h),
            "full": open_publisher(full_h),
            "broadcast": open_publisher(bc_h),
        }
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_report_versions, args=(bc_h, str(model_dir), dt, steps + 1, queue))
        child.start()
        engine_model = load_model(str(model_dir), wire).eval()
        engine = TorchEngine(engine_model, [2], 2, settings=EngineConfig(max_concurrent_seqs=group, max_seq_len=256))
        engine.receive_weights_on(torch.device("cpu"), wire)
        receiver = open_receiver(files_h, engine.weight_model, 1)
        engine.weights = receiver
        for publisher in publishers.values():
            publisher.connect()
        assert queue.get(timeout=300)[0] == "attached"
        rng, word = random.Random(0), word_dtype(files_h.layout)
        before = torch.cat([p.detach().reshape(-1).to(wire) for p in model.parameters()]).view(torch.uint8)
        try:
            for step in range(steps + 1):
                t0 = time.perf_counter()
                groups = _batch(engine, tok, rng, prompts, group, tokens, seed=100 * step)
                gen_s = time.perf_counter() - t0
                metrics = worker.step(groups).metrics
                version = worker.trainer.policy_version
                weights = worker.trainer.publishable()
                for name, publisher in publishers.items():
                    t0 = time.perf_counter()
                    publisher.publish(weights, version)
                    took, frac = time.perf_counter() - t0, publisher.sent_bytes / files_h.total_bytes
                    if name == "files":
                        run.files_s.append(took)
                        run.files.append(frac)
                    elif name == "full":
                        run.full_s.append(took)
                    else:
                        run.broadcast.append(frac)
                expected = weights_crc32(p.detach().to(wire) for _, p in model.named_parameters())
                while engine.gate.poll() is None:
                    time.sleep(0.005)
                assert engine.gate.apply() == version
                kind, (got, remote) = queue.get(timeout=300)
                run.crc.append(receiver_crc32(receiver) == expected == remote and got == version)
                after = torch.cat([p.detach().reshape(-1).to(wire) for p in model.parameters()]).view(torch.uint8)
                run.changed.append(diff(before, after, word, 1, 0).changed / (after.numel() // word.itemsize))
                before = after
                print(
                    f"  v{version}: gen {gen_s:.1f} s, train {metrics['train_s']:.1f} s, reward "
                    f"{sum(s.reward for g in groups for s in g.samples) / (prompts * group):.2f}, changed "
                    f"{run.changed[-1]:.2%}, broadcast {run.broadcast[-1]:.3f} / files {run.files[-1]:.3f} "
                    f"of the full version, CRC {'equal' if run.crc[-1] else 'DIFFERENT'}",
                    flush=True,
                )
        finally:
            receiver.close()
            for publisher in publishers.values():
                publisher.close()
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
    run.full_mib = files_h.total_bytes / 2**20
    return run


def report(run: Measured, steps: int) -> str:
    """Print the table; return the RESULT line."""
    measured = slice(1, None)  # the first publish carries the full version
    bc, files = run.broadcast[measured], run.files[measured]
    mib = run.full_mib
    print(
        f"\n{steps} steps at trainer.lr {run.lr:g} (trainer {run.precision}), weights in {run.wire}: "
        f"the full version is {mib:.0f} MiB; the first publish (full) left out\n"
    )
    print("| publisher | MiB a publish (median) | of the full version (mean) | publish s (median) |")
    print("|---|---|---|---|")
    print(f"| broadcast, deltas | {statistics.median(bc) * mib:.1f} | {statistics.mean(bc):.3f} | - |")
    print(
        f"| files, deltas | {statistics.median(files) * mib:.1f} | {statistics.mean(files):.3f} "
        f"| {statistics.median(run.files_s[measured]):.2f} |"
    )
    print(f"| files, full | {mib:.1f} | 1.000 | {statistics.median(run.full_s[measured]):.2f} |")
    crc = f"{sum(run.crc)}/{len(run.crc)}"
    changed = statistics.mean(run.changed[measured])
    print(f"\nCRC32 equal on both engines at {crc} versions; words changed a step: {changed:.2%}")
    return (
        f"RESULT delta_bytes_frac={statistics.mean(bc):.4f} files_delta_bytes_frac={statistics.mean(files):.4f} "
        f"first_full_included={statistics.mean(run.broadcast):.4f} crc_equal={crc} lr={run.lr:g} "
        f"changed_frac={statistics.mean(run.changed[measured]):.4f} "
        f"publish_s_delta={statistics.median(run.files_s[measured]):.3f} "
        f"publish_s_full={statistics.median(run.full_s[measured]):.3f}"
    )


def main(model_dir: str, steps: int) -> None:
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise SystemExit(f"--model: {model_dir} is not a model folder (no config.json)")
    run = measure(path, steps, prompts=2, group=4, tokens=24)
    print(report(run, steps))
