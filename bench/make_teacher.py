"""Build the shipped distillation teacher, nonstop/assets/addition-teacher.

The teacher of `bench/distill.py` and `distill.teacher: builtin` is the default job trained
further: the shipped base ('builtin', 26% held-out) after `--steps` steps of RL at depth 0.
It is built once and shipped, like the bases, because an RL run is
chaotic in floating point: rebuilt on another CPU it would be another teacher. This script
writes the folder and its provenance.json (command, settings, held-out accuracy, sha256 of
model.safetensors, versions, CPU capability); `nonstop.models.shipped.verify` checks the hash.

    python bench/make_teacher.py [--steps 1500] [--out src/nonstop/assets/addition-teacher]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from nonstop.api import train
from nonstop.models.shipped import PROVENANCE, sha256_file

ROOT = Path(__file__).resolve().parent.parent
KEEP = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base", default="builtin", help="the model RL starts from (model.base)")
    ap.add_argument("--out", type=Path, default=ROOT / "src" / "nonstop" / "assets" / "addition-teacher")
    ns = ap.parse_args()
    overrides = [
        f"run.max_steps={ns.steps}",
        "run.max_time_s=null",
        f"run.seed={ns.seed}",
        f"model.base={ns.base}",
        "buffer.depth=0",
        "checkpoint.every_steps=null",
        f"run.eval_every={max(1, ns.steps // 10)}",
    ]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nonstop-teacher-") as tmp:
        summary = train(overrides=[*overrides, f"run.out_dir={tmp}", "run.name=teacher"], progress="plain")
        curve = [
            (r["step"], r["eval_accuracy"])
            for r in map(json.loads, (Path(tmp) / "teacher" / "metrics.jsonl").read_text().splitlines())
            if r.get("eval_accuracy") is not None and "step" in r
        ]
        ns.out.mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            shutil.copyfile(Path(summary.final_dir) / name, ns.out / name)
    prov = {
        "command": " ".join(["python bench/make_teacher.py", *sys.argv[1:]]),
        "overrides": overrides,
        "base": ns.base,
        "steps": summary.steps,
        "eval_curve": curve,
        "base_accuracy": summary.base_accuracy,
        "heldout_accuracy": summary.final_accuracy,
        "sha256": sha256_file(ns.out / "model.safetensors"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (ns.out / PROVENANCE).write_text(json.dumps(prov, indent=1) + "\n")
    print(
        f"teacher: {summary.base_accuracy:.1%} -> {summary.final_accuracy:.1%} after {summary.steps} steps; "
        f"written to {ns.out}"
    )


if __name__ == "__main__":
    main()
