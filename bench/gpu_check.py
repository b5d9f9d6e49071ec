"""GPU check: the CUDA paths of the built-in engine, the trainer and the vLLM engine, in one script.

THIS SCRIPT HAS NOT RUN ON A GPU: the project's machines have none. It is written against the
device-agnostic code paths (nonstop/device.py) that the CPU tests exercise with device=cpu.

What it checks, on a machine with one CUDA GPU, in at most ~8 minutes:
1. depth 0 on CUDA: the shipped base in the built-in engine (engine.device cuda, float32) and in the
   trainer (trainer.device cuda); 16 prompts x 8 completions; the trainer's recomputed logprobs
   against the engine's behaviour logprobs (max |log ratio| < 1e-3: both float32 on one GPU, TF32
   off), then one trainer step whose ratio must be 1 within 1e-3;
2. a weight update through the shm transport's host path (transport.device_path host: the
   trainer copies its GPU weights into the host segment; the engine receives into its host
   staging copy and copies to the GPU at the swap): the engine's next tokens carry version 1 and
   match the trainer's new logprobs;
3. the same update GPU to GPU through CUDA IPC (shm, device_path ipc): an engine in another
   process maps the trainer's GPU slots and copies from them; its next tokens carry version 1 and
   match the trainer's logprobs, and the trainer's publisher counts the publish as a GPU-slot publish;
4. the same update over NCCL (broadcast, device_path nccl) to an engine on a second GPU (NCCL
   refuses two ranks on one GPU: skipped, and said so, on a one-GPU machine): the rendezvous
   must settle on NCCL; same assertions;
5. (with vllm installed) the default job with engine.kind vllm on the GPU for 120 s of RL:
   held-out accuracy must rise over the shipped base's.
With --device cpu, checks 3 and 4 run their two-process harness over the host paths (shm host
slots, broadcast over gloo) and say so: CUDA IPC and NCCL themselves are skipped on the CPU.
Run (from the repository root, in an environment with a CUDA torch and nonstop installed;
`pip install -e '.[vllm]'` for check 3):
    python bench/gpu_check.py
    python bench/gpu_check.py --device cpu --no-vllm   # dry run on the CPU (GPU-only parts skipped)
Last line: RESULT depth0_max_abs_log_ratio=<x> step_ratio_max_dev=<x> update_max_abs_log_ratio=<x>
ipc_max_abs_log_ratio=<x or skipped> nccl_max_abs_log_ratio=<x or skipped> vllm_gain_points=<x or n/a> ok=<true|false>
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from support.cli import sets  # noqa: E402


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def max_abs_log_ratio(trainer, groups) -> float:
    batch = trainer.batch_of(groups)
    with torch.no_grad():
        recomputed = trainer.logprobs(batch)
    m = batch["mask"]
    return float((recomputed[m] - batch["behaviour"][m]).abs().max())


def prompts(tok) -> list[list[int]]:
    return [tok(f"{3 * i:02d}+{7 * i % 100:02d}=")["input_ids"] for i in range(16)]


def requests(prompt_ids: list[list[int]]):
    from nonstop.types import GenerationRequest, SamplingParams

    return [
        GenerationRequest(i, p, 8, SamplingParams(max_new_tokens=4, temperature=1.0)) for i, p in enumerate(prompt_ids)
    ]


def shipped_engine(device: str):
    """The shipped base in a float32 built-in engine on `device` (TF32 off: ratios near 1 need exact
    matmuls); returns the engine, the tokenizer and the base's folder."""
    from nonstop.config import EngineConfig
    from nonstop.device import place
    from nonstop.engine.core import TorchEngine
    from nonstop.hf import load_model, load_tokenizer
    from nonstop.models.shipped import shipped_dir

    torch.backends.cuda.matmul.allow_tf32 = False
    path = str(shipped_dir())
    tok = load_tokenizer(path)
    engine = TorchEngine(
        place(load_model(path), torch.device(device)),
        [tok.eos_token_id],
        tok.pad_token_id,
        settings=EngineConfig(device=device, dtype="float32"),
    )
    return engine, tok, path


def engine_process(handle, device: str, inbox, outbox) -> None:
    """The engine end of checks 3-4, in its own process (CUDA IPC cannot map memory its own process
    exported, and NCCL needs one process per member): attach, wait for the publish, generate."""
    try:
        from nonstop.transport import open_receiver
        from nonstop.transport.device import receive_device

        dev = torch.device(device)
        engine, tok, _ = shipped_engine(device)
        where = receive_device(handle, dev)
        if where is not None:
            engine.receive_weights_on(where)
        receiver = open_receiver(handle, engine.weight_model, 1)
        engine.weights = receiver
        outbox.put(("attached", str(where or "cpu")))
        inbox.get()  # the trainer published version 1
        results = engine.generate(requests(prompts(tok)))
        outbox.put(("samples", (results, getattr(receiver, "copies", None), getattr(receiver, "backend", None))))
        receiver.close()
    except BaseException as e:  # reported to the parent, which fails the check naming it
        outbox.put(("error", f"{type(e).__name__}: {e}"))


def two_process_update(trainer, device: str, cfg, engine_device: str | None = None) -> tuple[float, dict]:
    """Publish the trainer's weights as version 1 to an engine in another process; the engine's next
    tokens must carry version 1; returns their max |log ratio| against the trainer and what the
    transport reports (GPU-slot publishes, the broadcast backend, the engine's copies)."""
    from nonstop.device import on
    from nonstop.transport import open_publisher, plan_transport
    from nonstop.types import Group

    handle = plan_transport(cfg, trainer.model, 1)
    publisher = open_publisher(handle)
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=engine_process, args=(handle, engine_device or device, inbox, outbox), daemon=True)
    child.start()
    try:
        publisher.connect()  # broadcast: the rendezvous that settles the backend
        kind, value = outbox.get(timeout=300)
        if kind == "error":
            fail(f"{cfg.kind} engine: {value}")
        publisher.publish(trainer.model, 1)
        inbox.put("published")
        kind, value = outbox.get(timeout=300)
        if kind == "error":
            fail(f"{cfg.kind} engine: {value}")
        results, copies, _ = value
        groups = [Group(i, "", "", s) for i, s in enumerate(results)]
        if not all(v == 1 for g in groups for s in g.samples for v in s.versions):
            fail(f"{cfg.kind} ({cfg.device_path}): tokens after the update do not carry version 1")
        with on(torch.device(device)):
            ratio = max_abs_log_ratio(trainer, groups)
        report = {
            "backend": getattr(publisher, "backend", None),
            "gpu_publishes": getattr(publisher, "gpu_publishes", None),
            "engine_copies": copies,
        }
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
        publisher.close()
    return ratio, report


def engine_and_trainer(device: str):
    from nonstop.config import ShmTransportConfig, TrainerConfig
    from nonstop.device import on, place
    from nonstop.hf import load_model
    from nonstop.trainer.core import Trainer
    from nonstop.transport import open_publisher, open_receiver, plan_transport
    from nonstop.types import Group

    cuda = torch.device(device)
    engine, tok, path = shipped_engine(device)
    trainer = Trainer(
        place(load_model(path), cuda), TrainerConfig(device=device), temperature=1.0, pad_token_id=tok.pad_token_id
    )
    reqs = requests(prompts(tok))

    def rollouts() -> list[Group]:
        groups = [Group(i, "", "", s) for i, s in enumerate(engine.generate(reqs))]
        for g in groups:
            for j, s in enumerate(g.samples):
                s.reward = float(j % 2)
        return groups

    handle = plan_transport(ShmTransportConfig(device_path="host"), trainer.model, 1)
    publisher = open_publisher(handle)
    receiver = open_receiver(handle, engine.weight_model)
    engine.weights = receiver
    try:
        groups = rollouts()
        with on(cuda):
            depth0 = max_abs_log_ratio(trainer, groups)
            metrics = trainer.step(groups)
        ratio_max, ratio_min = metrics["ratio_max"], metrics["ratio_min"]
        assert isinstance(ratio_max, float) and isinstance(ratio_min, float)  # the trainer reports both as floats
        ratio_dev = max(abs(ratio_max - 1), abs(ratio_min - 1))
        publisher.publish(trainer.model, trainer.policy_version)
        after = rollouts()
        if not all(v == 1 for g in after for s in g.samples for v in s.versions):
            fail("tokens after the update do not carry version 1")
        with on(cuda):
            update = max_abs_log_ratio(trainer, after)
    finally:
        receiver.close()
        publisher.close()
    return depth0, ratio_dev, update, trainer


def vllm_learning_run() -> float:
    with tempfile.TemporaryDirectory() as out:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "nonstop.cli",
                "train",
                *sets(
                    {
                        "engine.kind": "vllm",
                        "engine.vllm.memory_fraction": 0.3,
                        "run.max_time_s": 120,
                        "run.out_dir": out,
                        "run.name": "gpu",
                        "run.progress": "plain",
                    }
                ),
            ],
            capture_output=True,
            text=True,
            timeout=420,
        )
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
    depth0, ratio_dev, update, trainer = engine_and_trainer(args.device)
    print(f"1. depth 0 on {args.device}: max |log ratio| {depth0:.2e}; first step ratio within {ratio_dev:.2e} of 1")
    print(f"2. weight update (shm, host path): next tokens at version 1, max |log ratio| {update:.2e}")
    from nonstop.config import BroadcastTransportConfig, ShmTransportConfig

    gpu = args.device.startswith("cuda")
    ok = depth0 < 1e-3 and ratio_dev < 1e-3 and update < 1e-3
    ipc: float | None = None
    nccl: float | None = None
    if gpu:
        ipc, report = two_process_update(trainer, args.device, ShmTransportConfig(device_path="ipc", timeout_s=60))
        print(f"3. weight update through CUDA IPC: next tokens at version 1, max |log ratio| {ipc:.2e} ({report})")
        ok = ok and ipc < 1e-3 and report["gpu_publishes"] == 1 and report["engine_copies"] == 1
        if torch.cuda.device_count() < 2:  # NCCL refuses two ranks on one GPU
            print(
                "4. NCCL: SKIPPED: NCCL needs one GPU per member (trainer and engine), this machine shows "
                f"{torch.cuda.device_count()}"
            )
        else:
            other = "cuda:1" if torch.device(args.device).index in (None, 0) else "cuda:0"
            nccl, report = two_process_update(
                trainer, args.device, BroadcastTransportConfig(device_path="nccl", timeout_s=60), engine_device=other
            )
            print(
                f"4. weight update over NCCL ({args.device} -> {other}): next tokens at version 1, "
                f"max |log ratio| {nccl:.2e} ({report})"
            )
            ok = ok and nccl < 1e-3 and report["backend"] == "nccl"
    else:
        host, report = two_process_update(trainer, args.device, ShmTransportConfig(device_path="auto", timeout_s=60))
        print(
            f"3. CUDA IPC: SKIPPED on the CPU (needs a GPU); its two-process harness over shm host slots: "
            f"max |log ratio| {host:.2e} ({report})"
        )
        ok = ok and host < 1e-3 and report["gpu_publishes"] == 0
        gloo, report = two_process_update(
            trainer, args.device, BroadcastTransportConfig(device_path="auto", timeout_s=60)
        )
        print(
            f"4. NCCL: SKIPPED on the CPU (needs a GPU); its two-process harness over gloo: "
            f"max |log ratio| {gloo:.2e} ({report})"
        )
        ok = ok and gloo < 1e-3 and report["backend"] == "gloo"
    gain = vllm_learning_run() if importlib.util.find_spec("vllm") and not args.no_vllm else None
    print(
        "5. vLLM on the GPU, 120 s of RL: "
        + (f"{gain:+.1f} points held-out" if gain is not None else "skipped (vllm not installed or --no-vllm)")
    )
    ok = ok and (gain is None or gain > 0)
    print(
        f"RESULT depth0_max_abs_log_ratio={depth0:.2e} step_ratio_max_dev={ratio_dev:.2e} "
        f"update_max_abs_log_ratio={update:.2e} "
        f"ipc_max_abs_log_ratio={'skipped' if ipc is None else f'{ipc:.2e}'} "
        f"nccl_max_abs_log_ratio={'skipped' if nccl is None else f'{nccl:.2e}'} "
        f"vllm_gain_points={'n/a' if gain is None else f'{gain:.1f}'} "
        f"ok={'true' if ok else 'false'}"
    )
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
