"""GPU check: the CUDA paths of the built-in engine, the trainer and the vLLM engine, in one script.

THIS SCRIPT HAS NOT RUN ON A GPU: the project's machines have none. It is written against the
device-agnostic code paths (nonstop/device.py) that the CPU tests exercise with device=cpu.

What it checks, on a machine with one CUDA GPU, in at most ~8 minutes:
1. depth 0 on CUDA: the shipped base in the built-in engine (engine.device cuda, float32) and in the
   trainer (trainer.device cuda); 16 prompts x 8 completions; the trainer's recomputed logprobs
   against the engine's behaviour logprobs (max |log ratio| < 1e-3: both float32 on one GPU, TF32
   off), then one trainer step whose ratio must be 1 within 1e-3;
2. a weight update: the trained weights published through the shm transport (the trainer copies
   its GPU weights into the host buffer; the engine receives into its host staging copy and
   copies to the GPU at the swap - CUDA IPC is not implemented, see docs/vllm.md) and applied:
   the engine's next tokens carry version 1 and match the trainer's new logprobs;
3. (with vllm installed) the default job with engine.kind vllm on the GPU for 120 s of RL:
   held-out accuracy must rise over the shipped base's.
Run (from the repository root, in an environment with a CUDA torch and nonstop installed;
`pip install -e '.[vllm]'` for check 3):
    python bench/gpu_check.py
    python bench/gpu_check.py --device cpu --no-vllm   # dry run of checks 1-2 on the CPU
Last line: RESULT depth0_max_abs_log_ratio=<x> step_ratio_max_dev=<x> update_max_abs_log_ratio=<x>
vllm_gain_points=<x or n/a> ok=<true|false>
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def max_abs_log_ratio(trainer, groups) -> float:
    batch = trainer._batch(groups)
    with torch.no_grad():
        recomputed = trainer.logprobs(batch)
    m = batch["mask"]
    return float((recomputed[m] - batch["behaviour"][m]).abs().max())


def engine_and_trainer(device: str) -> tuple[float, float, float]:
    from nonstop.config import EngineConfig, ShmTransportConfig, TrainerConfig
    from nonstop.device import on, place
    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model, load_tokenizer
    from nonstop.tasks.base import shipped_dir
    from nonstop.trainer.core import Trainer
    from nonstop.transport import open_sink, open_source, plan_transport
    from nonstop.types import GenerationRequest, Group, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    cuda = torch.device(device)
    path = str(shipped_dir())
    tok = load_tokenizer(path)
    engine = TorchEngine(place(load_model(path), cuda), [tok.eos_token_id], tok.pad_token_id,
                         settings=EngineConfig(device=device, dtype="float32"))
    trainer = Trainer(place(load_model(path), cuda), TrainerConfig(device=device), temperature=1.0,
                      pad_token_id=tok.pad_token_id)
    reqs = [GenerationRequest(i, tok(f"{3 * i:02d}+{7 * i % 100:02d}=")["input_ids"], 8,
                              SamplingParams(max_new_tokens=4, temperature=1.0)) for i in range(16)]

    def rollouts() -> list[Group]:
        groups = [Group(i, "", "", s) for i, s in enumerate(engine.generate(reqs))]
        for g in groups:
            for j, s in enumerate(g.samples):
                s.reward = float(j % 2)
        return groups

    handle = plan_transport(ShmTransportConfig(), trainer.model, 1)
    sink = open_sink(handle)
    source = open_source(handle, engine.weight_model)
    engine.weights = source
    try:
        groups = rollouts()
        with on(cuda):
            depth0 = max_abs_log_ratio(trainer, groups)
            metrics = trainer.step(groups)
        ratio_dev = max(abs(metrics["ratio_max"] - 1), abs(metrics["ratio_min"] - 1))
        sink.publish(trainer.model, trainer.policy_version)
        after = rollouts()
        if not all(v == 1 for g in after for s in g.samples for v in s.versions):
            fail("tokens after the update do not carry version 1")
        with on(cuda):
            update = max_abs_log_ratio(trainer, after)
    finally:
        source.close()
        sink.close()
    return depth0, ratio_dev, update


def vllm_learning_run() -> float:
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run(
            [sys.executable, "-m", "nonstop.cli", "train", "--set", "engine.kind=vllm",
             "--set", "engine.vllm.memory_fraction=0.3", "--set", "run.max_time_s=120",
             "--set", f"run.out_dir={out}", "--set", "run.name=gpu", "--set", "run.progress=plain"],
            capture_output=True, text=True, timeout=420)
        if result.returncode != 0:
            fail(f"the vLLM run failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        summary = json.loads((Path(out) / "gpu" / "summary.json").read_text())
    return 100 * (summary["final_accuracy"] - summary["base_accuracy"])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of checks 1-2 on the CPU (tests this script)")
    ap.add_argument("--no-vllm", action="store_true", help="skip check 3")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("no CUDA device visible to torch: nothing checked")
            sys.exit(2)
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    depth0, ratio_dev, update = engine_and_trainer(args.device)
    print(f"1. depth 0 on {args.device}: max |log ratio| {depth0:.2e}; first step ratio within {ratio_dev:.2e} of 1")
    print(f"2. weight update (shm, host staging): next tokens at version 1, max |log ratio| {update:.2e}")
    gain = vllm_learning_run() if importlib.util.find_spec("vllm") and not args.no_vllm else None
    print("3. vLLM on the GPU, 120 s of RL: " + (f"{gain:+.1f} points held-out" if gain is not None else "vllm not installed"))
    ok = depth0 < 1e-3 and ratio_dev < 1e-3 and update < 1e-3 and (gain is None or gain > 0)
    print(f"RESULT depth0_max_abs_log_ratio={depth0:.2e} step_ratio_max_dev={ratio_dev:.2e} "
          f"update_max_abs_log_ratio={update:.2e} vllm_gain_points={'n/a' if gain is None else f'{gain:.1f}'} "
          f"ok={'true' if ok else 'false'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
