"""Weight-transport latency: each transport against a plain memcpy of the same bytes.

For a small (~3 M parameters) and a large (~200 M) fp32 model, each laid out as many small
tensors or as a few large ones, measures publish-to-applied time:
- memcpy: one `copy_` of the flat bytes (the limit of any same-host transport);
- shm: trainer copies its flat buffer into a free slot + engine points its parameters at that
  slot (same process, the same work as across processes);
- files: safetensors write + fsync + rename, then the engine's load (same process);
- broadcast: gloo over loopback to an engine process, bucketed (25 MiB) and per tensor, and a
  bucket-size sweep on the 200 M layouts; publish() returns once the engine acknowledged the
  complete version.
Then LoRA: a ~200 M-parameter stack of Linear layers shaped like a transformer, full sync
against adapter-only sync (peft, rank 16 on every Linear) for each transport, and the
engine's merge W = W0 + s * B @ A reported on its own.
Prints ratios measured side by side. Run: python bench/transport.py [--repeats 3]

`--model DIR` instead measures weights sent as deltas on a real model (bench/transport_delta.py: a real
RL loop, files and broadcast with `transport.delta`, CRC32 per version) and ends with its RESULT line:
python bench/transport.py --model .nonstop_cache/models/smollm2 [--steps 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
from typing import TYPE_CHECKING, cast

import torch

from nonstop.config import BroadcastTransportConfig, FilesTransportConfig, LoraConfig, ShmTransportConfig
from nonstop.transport import open_publisher, open_receiver, plan_transport

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from nonstop.lora import MergedAdapters
    from nonstop.transport.base import WeightReceiver

LAYOUTS = {
    "3M many-small": [(100, 100)] * 300,
    "3M few-large": [(1000, 1000)] * 3,
    "200M many-small": [(316, 316)] * 2000,
    "200M few-large": [(5000, 5000)] * 8,
}


class Synthetic(torch.nn.Module):
    def __init__(self, shapes, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes])


class Block(torch.nn.Module):
    """Linear layers of one transformer block (attention and MLP projections, no bias)."""

    def __init__(self, width: int, mlp: int) -> None:
        super().__init__()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            self.add_module(name, torch.nn.Linear(width, width, bias=False))
        self.gate_proj = torch.nn.Linear(width, mlp, bias=False)
        self.up_proj = torch.nn.Linear(width, mlp, bias=False)
        self.down_proj = torch.nn.Linear(mlp, width, bias=False)


class LinearStack(torch.nn.Module):
    """~201 M parameters: 12 blocks of width 1024, MLP 4096."""

    def __init__(self, seed=0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.ModuleList([Block(1024, 4096) for _ in range(12)])


LORA = LoraConfig(enabled=True, rank=16, alpha=32.0)


def _make(spec):
    return LinearStack(seed=1) if spec == "stack" else Synthetic(spec, seed=1)


def _receiver(handle, spec, done):
    torch.set_num_threads(1)
    src = open_receiver(handle, _make(spec), 1)
    done.wait()
    src.close()


def _broadcast(handle_cfg, trainer, spec, repeats, lora=None):
    """Best publish time (until the engine process acknowledged) over a real gloo group."""
    handle = plan_transport(handle_cfg, trainer, 1, lora)
    publisher = open_publisher(handle)
    done = mp.get_context("spawn").Event()
    child = mp.get_context("spawn").Process(target=_receiver, args=(handle, spec, done))
    child.start()
    publisher.connect()
    version = [0]

    def once():
        version[0] += 1
        publisher.publish(trainer, version[0])

    best = _best(once, repeats)
    done.set()
    publisher.close()
    child.join(timeout=60)
    return best


def _adapters(receiver: WeightReceiver) -> MergedAdapters:
    """The adapters the engine's end of a same-process LoRA handle merges (and times its merges in)."""
    from nonstop.lora import MergedAdapters
    from nonstop.transport.files import FilesReceiver
    from nonstop.transport.shm import ShmReceiver

    assert isinstance(receiver, (ShmReceiver, FilesReceiver))  # the same-process transports
    assert isinstance(receiver.target, MergedAdapters)  # a LoRA handle's engine target
    return receiver.target


def _same_process(kind, trainer, engine, repeats, lora=None):
    """Best publish + apply time of shm or files, both ends in this process; with LoRA also the
    best time of the same calls without the engine's merge (the merge is timed inside them)."""
    with tempfile.TemporaryDirectory() as d:
        handle = plan_transport(
            FilesTransportConfig(dir=d) if kind == "files" else ShmTransportConfig(), trainer, 1, lora
        )
        publisher = open_publisher(handle)
        receiver = open_receiver(handle, engine)
        version, without_merge = [0], []
        adapters = _adapters(receiver) if lora else None

        def once():
            version[0] += 1
            merged_before = adapters.merge_s if adapters is not None else 0.0
            t0 = time.perf_counter()
            publisher.publish(trainer, version[0])
            assert receiver.maybe_update(engine) == version[0]
            merge = (adapters.merge_s - merged_before) if adapters is not None else 0.0
            without_merge.append(time.perf_counter() - t0 - merge)

        best = _best(once, repeats, warmup=3)  # shm: N + 2 = 3 slots to touch once
        receiver.close()
        publisher.close()
    return best, min(without_merge[3:]), handle.total_bytes


def _best(fn, repeats, warmup=1):
    """Best of `repeats` timed calls after `warmup` untimed ones (first-touch page faults of
    every shm slot, the trainer's one-time re-homing into its flat buffer)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_layout(name, shapes, repeats):
    trainer = Synthetic(shapes)
    flat_bytes = sum(p.numel() * 4 for p in trainer.parameters())
    src, dst = torch.empty(flat_bytes, dtype=torch.uint8), torch.empty(flat_bytes, dtype=torch.uint8)
    out = {"memcpy": _best(lambda: dst.copy_(src), repeats)}
    for kind in ("shm", "files"):
        out[kind] = _same_process(kind, trainer, Synthetic(shapes, seed=1), repeats)[0]
    sweep = [
        ("broadcast 25MiB", BroadcastTransportConfig(timeout_s=300, bucket_mb=25)),
        ("broadcast per-tensor", BroadcastTransportConfig(timeout_s=300, per_tensor=True)),
    ]
    if name.startswith("200M"):
        sweep += [
            (f"broadcast {mb}MiB", BroadcastTransportConfig(timeout_s=300, bucket_mb=mb)) for mb in (1, 4, 16, 64, 256)
        ]
    for label, cfg in sweep:
        out[label] = _broadcast(cfg, trainer, shapes, repeats)
    return flat_bytes, out


def bench_lora(repeats):
    """Full sync vs adapter-only sync of the same ~200 M model, per transport."""
    from nonstop.lora import MergedAdapters, wrap_with_peft

    trainer = LinearStack()
    full_bytes = sum(p.numel() * 4 for p in trainer.parameters())
    # peft wraps any torch module (its custom-models path); wrap_with_peft is typed for the HF models training gives it
    peft_trainer = wrap_with_peft(cast("PreTrainedModel", LinearStack()), LORA)
    rows = {}
    for kind in ("shm", "files"):
        full = _same_process(kind, trainer, LinearStack(seed=1), repeats)[0]
        lora, lora_sync, nbytes = _same_process(kind, peft_trainer, LinearStack(seed=1), repeats, LORA)
        rows[kind] = (full, lora_sync, lora)
    full = _broadcast(BroadcastTransportConfig(timeout_s=300), trainer, "stack", repeats)
    lora = _broadcast(BroadcastTransportConfig(timeout_s=300), peft_trainer, "stack", repeats, LORA)
    rows["broadcast (until acked)"] = (full, lora, None)
    merged = MergedAdapters(LinearStack(seed=1), LORA)
    merge_s = _best(merged.applied, repeats)
    return full_bytes, nbytes, rows, merge_s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--model", help="a model folder: measure weights sent as deltas on it (bench/transport_delta.py)")
    ap.add_argument("--steps", type=int, default=20, help="with --model: measured steps after the first")
    ns = ap.parse_args()
    if ns.model:
        import transport_delta

        transport_delta.main(ns.model, ns.steps)
        return
    torch.set_num_threads(1)
    for name in filter(None, ns.layouts.split(",")):
        nbytes, out = bench_layout(name, LAYOUTS[name], ns.repeats)
        base = out["memcpy"]
        print(f"\n{name}: {len(LAYOUTS[name])} tensors, {nbytes / 2**20:.0f} MiB (best of {ns.repeats})")
        print(f"  {'transport':<22}{'ms':>10}{'x memcpy':>10}")
        for k, v in out.items():
            print(f"  {k:<22}{v * 1e3:>10.2f}{v / base:>10.2f}")
        buckets = {k: v for k, v in out.items() if k.startswith("broadcast") and k.endswith("MiB")}
        best = min(buckets, key=buckets.__getitem__)
        print(
            f"  bucketed / per-tensor: 25MiB {out['broadcast 25MiB'] / out['broadcast per-tensor']:.2f}, "
            f"best ({best.split()[1]}) {buckets[best] / out['broadcast per-tensor']:.2f}"
        )
    if not ns.no_lora:
        full_bytes, lora_bytes, rows, merge_s = bench_lora(ns.repeats)
        print(
            f"\nLoRA rank {LORA.rank} on every Linear of a {full_bytes / 4e6:.0f}M-parameter stack: "
            f"{lora_bytes / 2**20:.1f} MiB of adapters vs {full_bytes / 2**20:.0f} MiB (best of {ns.repeats})"
        )
        print(f"  {'transport':<25}{'full ms':>9}{'LoRA sync':>11}{'/full':>7}{'+ merge':>10}{'/full':>7}")
        for k, (full, sync, total) in rows.items():
            merged = f"{total * 1e3:>10.1f}{total / full:>7.3f}" if total is not None else f"{'-':>10}{'-':>7}"
            print(f"  {k:<25}{full * 1e3:>9.1f}{sync * 1e3:>11.1f}{sync / full:>7.3f}{merged}")
        print(f"  engine merge W = W0 + s*B@A of every adapted weight on its own: {merge_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
