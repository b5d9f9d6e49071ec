"""Separate policies per role (env.policies) with vLLM engines (real vLLM; `make test-vllm`): the
two-role Duel, role 'b' on its own policy, both policies' engines vLLM. Both policies step, the own
policy's vLLM engine generates with weights its own trainer published, no part is settled twice."""

from __future__ import annotations

import json

import pytest

from nonstop.config import TinyModelConfig
from nonstop.models.tiny import save_tiny
from support.cli import nonstop, sets
from support.two_role_env import duel_args

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_two_policies_on_vllm_engines(tmp_path):
    model = save_tiny(
        tmp_path / "tiny",
        TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
    )
    args = duel_args(model, tmp_path, 2, None, *sets({"engine.kind": "vllm", "engine.vllm.kv_cache_gib": 0.25}))
    out = nonstop(["train", *args], tmp_path, timeout_s=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s = json.loads((tmp_path / "duel" / "summary.json").read_text())
    shared, own, ledger = s["policies"]["shared"], s["policies"]["b"], s["prompts"]
    assert shared["steps"] == 2 and own["steps"] >= 1 and own["policy_version"] == own["steps"]
    assert set(shared["samples_by_role"]) == {"a"} and set(own["samples_by_role"]) == {"b"}
    assert 1 <= max(own["engine_versions"]) <= own["policy_version"]
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0
