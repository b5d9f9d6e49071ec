"""Rows of the real-model matrix (bench/real_matrix.py) in the slow tier: each is a few steps of a real
`nonstop` command on SmolLM2-135M-Instruct, ok only on its evidence (weights crc equal between the
trainer and the engines, the adapters alone published, the resumed run's steps and weights equal to
the uninterrupted run's, a tool episode's ids exact across turns). The whole matrix is the bench's;
these are the rows that fit CI's time."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_real_matrix", ROOT / "bench" / "real_matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("row", ["builtin", "lora", "resume", "multiturn_tool"])
def test_a_row_of_the_real_model_matrix_is_ok_on_its_evidence(row, smollm2_dir, tmp_path):
    bench = load_bench()
    ctx = bench.make_ctx(tmp_path)
    assert ctx.model == Path(smollm2_dir)
    result = bench.one_row(row, ctx)
    print(f"{row}: {result.evidence}")
    assert result.ok, result.evidence


def test_an_unknown_row_is_refused_naming_the_known_ones(capsys, monkeypatch):
    bench = load_bench()
    monkeypatch.setattr("sys.argv", ["real_matrix.py", "--rows", "builtin,nope"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert "--rows: unknown nope" in str(e.value) and "builtin" in str(e.value)
