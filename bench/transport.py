"""Weight-transport latency: each transport against a plain memcpy of the same bytes.

For a small (~3 M parameters) and a large (~200 M) fp32 model, each laid out as many small
tensors or as a few large ones, measures publish-to-applied time:
- memcpy: one `copy_` of the flat bytes (the limit of any same-host transport);
- shm: trainer writes a slot + engine copies slot -> shadow -> parameters (same process, the
  same copies as across processes);
- files: safetensors write + fsync + rename, then the engine's load (same process);
- broadcast: gloo over loopback to an engine process, bucketed (25 MiB) and per tensor, and a
  bucket-size sweep; publish() returns once the engine acknowledged the complete version.
Prints ratios to memcpy measured side by side. Run: python bench/transport.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import torch

from nonstop.config import TransportConfig
from nonstop.transport import open_sink, open_source, plan_transport

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


def _receiver(handle, shapes, done):
    torch.set_num_threads(1)
    src = open_source(handle, Synthetic(shapes, seed=1), 1)
    done.wait()
    src.close()


def _best(fn, repeats):
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
    version = [0]
    for kind in ("shm", "files"):
        with tempfile.TemporaryDirectory() as d:
            handle = plan_transport(TransportConfig(kind=kind, files_dir=d), trainer, 1)
            sink, engine = open_sink(handle), Synthetic(shapes, seed=1)
            source = open_source(handle, engine)

            def once():
                version[0] += 1
                sink.publish(trainer, version[0])
                assert source.maybe_update(engine) == version[0]

            out[kind] = _best(once, repeats)
            source.close()
            sink.close()
    sweep = [("broadcast 25MiB", {"bucket_mb": 25}), ("broadcast per-tensor", {"per_tensor": True})]
    if name.startswith("200M few"):
        sweep += [(f"broadcast {mb}MiB", {"bucket_mb": mb}) for mb in (1, 4, 100)]
    ctx = mp.get_context("spawn")
    for label, kw in sweep:
        handle = plan_transport(TransportConfig(kind="broadcast", timeout_s=300, **kw), trainer, 1)
        sink = open_sink(handle)
        done = ctx.Event()
        child = ctx.Process(target=_receiver, args=(handle, shapes, done))
        child.start()
        sink.connect()
        version[0] = 0

        def once():
            version[0] += 1
            sink.publish(trainer, version[0])

        out[label] = _best(once, repeats)
        done.set()
        sink.close()
        child.join(timeout=60)
    return flat_bytes, out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ns = ap.parse_args()
    torch.set_num_threads(1)
    for name in ns.layouts.split(","):
        nbytes, out = bench_layout(name, LAYOUTS[name], ns.repeats)
        base = out["memcpy"]
        print(f"\n{name}: {len(LAYOUTS[name])} tensors, {nbytes / 2**20:.0f} MiB (best of {ns.repeats})")
        print(f"  {'transport':<22}{'ms':>10}{'x memcpy':>10}")
        for k, v in out.items():
            print(f"  {k:<22}{v * 1e3:>10.2f}{v / base:>10.2f}")
        if "broadcast per-tensor" in out:
            print(f"  bucketed / per-tensor: {out['broadcast 25MiB'] / out['broadcast per-tensor']:.2f}")


if __name__ == "__main__":
    main()
