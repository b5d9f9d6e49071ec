"""The vLLM row of the real-model matrix (bench/real_matrix.py) in the vLLM tier: SmolLM2-135M-Instruct
trains three steps with vLLM generating (`make test-vllm`, in .venv-vllm), and at the end every
engine's weights crc equals the trainer's, after in-place swaps, with the engine sampling what the
trainer scores (step 1's behaviour/trainer KL)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_row_of_the_real_model_matrix(smollm2_dir, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_real_matrix", ROOT / "bench" / "real_matrix.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    spec.loader.exec_module(bench)
    ctx = bench.make_ctx(tmp_path)
    assert ctx.model == Path(smollm2_dir)
    row = bench.row_vllm(ctx, python=Path(sys.executable))  # this venv is the one with vllm
    print(row.evidence)
    assert row.ok, row.evidence
