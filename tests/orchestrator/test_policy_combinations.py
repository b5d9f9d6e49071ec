"""Separate policies per role (env.policies) with what was refused for them before: the Ray backend,
the broadcast and files transports, two trainer ranks per policy, LoRA (the vLLM engine is in
tests/vllm_engine/test_vllm_policies.py, textarena in tests/envs/test_textarena_env.py).

Each run is the real CLI, the two-role Duel with role 'b' on its own policy, once per
combination; each asserts that both policies stepped, that the own policy's engine generated
with weights its own trainer published through the transport under test, and that the ledger
counted no part twice. The broadcast run is in the default tier (about 35-50 s: the one real
pipeline of two policies there), the others are slow. Also in the default tier, the two places
where a second policy needed a change of code, on the real parts: two policies' files
transports in one user-named folder (each its own subfolder, so neither applies the other's
weights) and the Ray resources of an own policy's actors.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from nonstop.config import load_config
from nonstop.hf import load_model
from nonstop.orchestrator.modes.own_policies.policy_build import policy_config
from nonstop.transport import open_publisher, open_receiver, plan_transport
from support.two_role_env import duel_args
from support.weights import perturbed_model

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
DUEL = ["env.name=support.two_role_env:Duel", "env.policies.b.lr=0.003"]
STEPS = 3
"""Shared-policy steps of each run. A row is admitted only when every policy's buffer admits it,
at depth 1 two batches past the policy's steps; with no part ever dropped (uniform groups kept,
and every Duel episode has turns of both roles) nothing is refunded, so the shared policy's third
batch waits until the own policy has trained its first: it steps at least once, however loaded
the machine."""


def test_two_policies_files_transports_in_one_named_folder_each_apply_their_own_weights(tiny_dir, tmp_path):
    """transport.dir names one folder; the own policy's trainer writes under <dir>/policy-b. Both
    trainers publish their version 1 (versions count per policy); each engine applies its own
    trainer's weights. (In one folder the second trainer's v1 file and LATEST marker would replace
    the first's, and the shared policy's engine would load the other policy's weights.)"""
    cfg = load_config(None, [*DUEL, "transport.kind=files", f"transport.dir={tmp_path / 'w'}"])
    assert cfg.env is not None
    own = policy_config(cfg, cfg.env.policies["b"], 0, "b")
    trainers = {"": perturbed_model(tiny_dir, seed=1), "b": perturbed_model(tiny_dir, seed=2)}
    handles = {"": plan_transport(cfg.transport, trainers[""], 1), "b": plan_transport(own.transport, trainers["b"], 1)}
    publishers = {p: open_publisher(h) for p, h in handles.items()}
    engines = {p: load_model(str(tiny_dir)) for p in handles}
    receivers = {p: open_receiver(h, engines[p]) for p, h in handles.items()}
    for p in handles:
        publishers[p].publish(trainers[p], 1)
    for p in handles:
        assert receivers[p].maybe_update(engines[p]) == 1
        for name, weight in engines[p].named_parameters():
            assert torch.equal(weight, dict(trainers[p].named_parameters())[name]), (p, name)
    assert not torch.equal(engines[""].model.norm.weight, engines["b"].model.norm.weight)
    assert (tmp_path / "w" / "LATEST").exists() and (tmp_path / "w" / "policy-b" / "LATEST").exists()
    for publisher in publishers.values():
        publisher.close()


@needs_ray
def test_an_own_policys_ray_actors_get_the_engine_and_trainer_resources():
    """An own policy's actors are named '<role>-engine', '<role>-trainer-<rank>': Ray reserves what
    runtime.ray_engine / ray_trainer say for them, as for the shared policy's (a 2-CPU cluster
    holds two policies' engines and trainers at half a CPU each)."""
    from nonstop.runtime.pinning import role_of
    from nonstop.runtime.ray import _resources

    cfg = load_config(
        None, ["runtime.backend=ray", "runtime.ray_engine.num_cpus=0.5", "runtime.ray_trainer.num_cpus=0.25"]
    ).runtime
    for name, cpus in (
        ("engine", 0.5),
        ("b-engine", 0.5),
        ("b-engine-1", 0.5),
        ("trainer-0", 0.25),
        ("b-trainer", 0.25),
        ("b-trainer-1", 0.25),
        ("teacher", 1.0),
    ):
        assert _resources(cfg, role_of(name) or name, 0.0) == {"num_cpus": cpus, "num_gpus": 0.0}, name


def _duel(tiny_dir: Path, tmp_path: Path, steps: int, *overrides: str) -> dict:
    """Run the Duel through the real CLI with `overrides` ("key=value"); its summary.json."""
    from support.cli import nonstop, sets

    extra = sets(["rollout.filter_uniform_reward=false", *overrides])
    out = nonstop(["train", *duel_args(tiny_dir, tmp_path, steps, None, *extra)], tmp_path, timeout_s=400)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads((tmp_path / "duel" / "summary.json").read_text())


def _both_policies_trained(s: dict, steps: int) -> dict:
    """Both policies stepped, each on its own role; the own policy's engine generated with a version
    its own trainer published (its versions count its own steps); no part settled twice."""
    shared, own, ledger = s["policies"]["shared"], s["policies"]["b"], s["prompts"]
    assert shared["steps"] == steps and s["policy_version"] == steps
    assert own["steps"] >= 1 and own["policy_version"] == own["steps"]
    assert set(shared["samples_by_role"]) == {"a"} and set(own["samples_by_role"]) == {"b"}
    assert 1 <= max(own["engine_versions"]) <= own["policy_version"]  # its engine applied its trainer's weights
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0
    assert ledger["settled"] >= 4 * min(steps, own["steps"])  # a row settles once both policies settled it
    return own


@pytest.mark.slow
@needs_ray
def test_two_policies_on_a_ray_cluster(tiny_dir, tmp_path):
    """A private 2-CPU Ray cluster holds both policies' engines and trainers (half a CPU each)."""
    s = _duel(
        tiny_dir,
        tmp_path,
        STEPS,
        "runtime.backend=ray",
        "runtime.ray_num_cpus=2",
        "runtime.ray_engine.num_cpus=0.5",
        "runtime.ray_trainer.num_cpus=0.5",
    )
    _both_policies_trained(s, STEPS)


@pytest.mark.slow  # a whole CLI run (25-75 s); the default tier keeps the files and Ray placement checks
def test_two_policies_with_broadcast_transports(tiny_dir, tmp_path):
    """Each policy's trainer broadcasts to its own engines in a process group of its own."""
    own = _both_policies_trained(_duel(tiny_dir, tmp_path, STEPS, "transport.kind=broadcast"), STEPS)
    lines = [json.loads(x) for x in (tmp_path / "duel" / "policies" / "b" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["publish_bytes"] > 0 for r in lines) and len(lines) >= own["steps"]


@pytest.mark.slow
def test_two_policies_with_files_transports_in_one_named_folder(tiny_dir, tmp_path):
    folder = tmp_path / "weights"
    own = _both_policies_trained(
        _duel(tiny_dir, tmp_path, STEPS, "transport.kind=files", f"transport.dir={folder}"), STEPS
    )
    assert (folder / "LATEST").read_text() == str(STEPS)  # the shared policy's versions
    assert int((folder / "policy-b" / "LATEST").read_text()) >= own["steps"]  # the own policy's


@pytest.mark.slow
def test_two_policies_with_two_trainer_ranks_each(tiny_dir, tmp_path):
    """trainer.ranks=2: each policy's step runs on two data-parallel ranks (both ranks' span logs
    show every step of their policy)."""
    own = _both_policies_trained(_duel(tiny_dir, tmp_path, STEPS, "trainer.ranks=2"), STEPS)
    spans = tmp_path / "duel" / "spans"
    for prefix, steps in (("trainer", STEPS), ("b-trainer", own["steps"])):
        for rank in (0, 1):
            events = [json.loads(x) for x in (spans / f"{prefix}-{rank}.jsonl").read_text().splitlines()]
            versions = [e["version"] for e in events if e["ev"] == "step"]
            assert versions[:steps] == list(range(1, steps + 1)), (prefix, rank, versions)


@pytest.mark.slow
def test_two_policies_of_a_lora_run_both_train_adapters(tiny_dir, tmp_path):
    """model.lora.enabled: the own policy trains adapters too (env.policies.b.lora unset follows
    model.lora), so both transports carry the same small adapter payload and both final folders
    are adapters."""
    _both_policies_trained(_duel(tiny_dir, tmp_path, STEPS, "model.lora.enabled=true", "model.lora.rank=2"), STEPS)
    run = tmp_path / "duel"
    shared = [
        r["publish_bytes"]
        for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        if "publish_bytes" in r
    ]
    own = [json.loads(x)["publish_bytes"] for x in (run / "policies" / "b" / "metrics.jsonl").read_text().splitlines()]
    full = sum(p.numel() * p.element_size() for p in load_model(str(tiny_dir)).parameters())
    assert set(shared) == set(own) and max(own) * 4 < full
    assert (run / "final" / "adapter_config.json").exists()
    assert (run / "policies" / "b" / "final" / "adapter_config.json").exists()
