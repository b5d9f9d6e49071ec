"""Weights sent as deltas (transport.delta, transport/delta.py): the encoding on its own, then the files
and broadcast transports carrying small updates, every version rebuilt bit for bit (CRC32 per version)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from pydantic import TypeAdapter

from nonstop.config import TransportConfig
from nonstop.hf import load_model
from nonstop.transport import TransportError, open_publisher, open_receiver, plan_transport
from nonstop.transport.base import receiver_crc32
from nonstop.transport.delta import ESCAPE, Chain, Delta, DeltaEncoder, Held, diff
from support.deltas import cast_crc, nudge, report_versions

STEP = 1e-5  # about an RL learning rate's AdamW step (SmolLM2 resolves 8.6e-6), on weights of ~0.02


def transport(**fields) -> TransportConfig:
    return TypeAdapter(TransportConfig).validate_python(fields)


def test_delta_round_trip_keeps_every_bit_and_escapes_long_gaps():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(70_000, generator=g).to(torch.bfloat16)
    new = old.clone()
    changed = torch.tensor([0, 1, 254, 255, 300, 556, 40_000, 69_999])  # gaps of 1, 253, 255 (escaped), 256, ...
    new[changed] = new[changed] * 1.5 + 0.01
    new[5] = -0.0 if old[5] != 0 else 1.0
    new[6] = float("nan")
    old_b, new_b = old.view(torch.uint8), new.view(torch.uint8)
    d = diff(old_b, new_b, torch.int16, version=2, base=1)
    assert d.changed == len(changed) + 2 and int((d.gaps == ESCAPE).sum()) == d.far.numel() > 0
    packed = d.pack()
    assert packed.numel() == d.nbytes < new_b.numel() // 100
    back = Delta.unpack(packed, 2, 1, torch.int16, None)
    rebuilt = old_b.clone()
    back.apply(rebuilt, torch.int16)
    assert torch.equal(rebuilt, new_b)  # bits, -0.0 and the NaN included
    with pytest.raises(TransportError, match="header says .* the payload has"):
        Delta.unpack(packed[:-8], 2, 1, torch.int16, None)


def test_encoder_sends_full_first_when_asked_and_where_a_delta_is_not_smaller(tiny_dir):
    model = load_model(str(tiny_dir))
    handle = plan_transport(transport(kind="files", dtype="bfloat16", delta=True), model, 1)
    enc = DeltaEncoder(handle)
    flat = torch.randn(handle.total_bytes // 2).to(torch.bfloat16).view(torch.uint8)
    assert enc.encode(flat, 1, None) is None  # nothing to compare with yet
    small = flat.clone()
    small.view(torch.int16)[::100] += 1
    d = enc.encode(small, 2, 123)
    assert d is not None and d.base == 1 and d.crc == 123 and d.changed == (flat.numel() // 2 + 99) // 100
    assert torch.equal(enc.last, small)  # the last sent bytes moved along
    assert enc.encode(small, 3, None, full=True) is None
    everything = small.clone()
    everything.view(torch.int16).add_(1)
    assert enc.encode(everything, 4, None) is None  # 3 bytes a word against 2: the full version goes
    assert torch.equal(enc.last, everything)
    assert enc.encode(everything, 4, None) is None  # not newer than the last: full


def test_chain_brings_a_buffer_forward_or_copies_a_newer_one_and_checks_the_crc(tiny_dir):
    from nonstop.transport.base import crc32

    model = load_model(str(tiny_dir))
    handle = plan_transport(transport(kind="files", dtype="bfloat16", delta=True), model, 1)
    n = handle.total_bytes
    versions = [torch.randn(n // 2, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).view(torch.uint8)]
    for v in range(1, 4):
        nxt = versions[-1].clone()
        nxt.view(torch.int16)[v::50] += 1
        versions.append(nxt)
    chain = Chain(handle)
    for v in range(1, 4):
        chain.add(diff(versions[v - 1], versions[v], torch.int16, v, v - 1))
    chain.links[3].crc = crc32(versions[3])
    old, newer, fresh = (
        Held(handle, torch.device("cpu")),
        Held(handle, torch.device("cpu")),
        Held(handle, torch.device("cpu")),
    )
    old.flat.copy_(versions[0])
    old.version = 0
    newer.flat.copy_(versions[2])
    newer.version = 2
    chain.bring(old, 3, [newer])  # along three deltas, no copy
    assert old.version == 3 and torch.equal(old.flat, versions[3])
    chain.bring(fresh, 3, [newer])  # a buffer holding nothing starts from a copy of the newer one
    assert torch.equal(fresh.flat, versions[3])
    chain.prune([newer])
    assert sorted(chain.links) == [3]
    stale = Held(handle, torch.device("cpu"))
    stale.version = 0
    with pytest.raises(TransportError, match=r"holds only version\(s\) \[0\]"):
        chain.bring(stale, 3, [])
    chain.links[3].crc ^= 1
    with pytest.raises(TransportError, match="version 3 rebuilt from deltas failed its checksum"):
        chain.bring(newer, 3, [])
    assert newer.version is None  # a failed rebuild leaves the buffer holding no known version


def _files_engine(handle, tiny_dir):
    engine = load_model(str(tiny_dir), torch.bfloat16)
    return engine, open_receiver(handle, engine, 1)


@pytest.mark.parametrize("notify", ["marker", "http"])
def test_files_deltas_rebuild_every_version_exactly_and_a_late_engine_starts_from_a_full_file(
    tiny_dir, tmp_path, notify
):
    """Ten small updates through the files transport with deltas: after the first, each file is a small
    fraction of the full layout; the engine's CRC equals the trainer's cast at every version, also when it
    skips versions (two deltas applied in a row); full files every 4 versions, `keep` of them; an engine
    that attaches late starts from the newest full file and the deltas after it."""
    import time

    trainer = load_model(str(tiny_dir))
    cfg = transport(
        kind="files",
        dir=str(tmp_path / "w"),
        dtype="bfloat16",
        delta=True,
        full_every=4,
        keep=2,
        checksum=True,
        notify=notify,
    )
    handle = plan_transport(cfg, trainer, 1)
    publisher = open_publisher(handle)
    publisher.connect()
    engine, receiver = _files_engine(handle, tiny_dir)
    fracs = []

    def until(v, src, model):
        deadline = time.monotonic() + 30
        while (got := src.maybe_update(model)) != v:
            assert got is None or got < v
            assert time.monotonic() < deadline, f"version {v} never arrived"
            time.sleep(0.005)

    try:
        for v in range(1, 11):
            nudge(trainer, STEP, seed=v)
            publisher.publish(trainer, v)
            fracs.append(publisher.sent_bytes / handle.total_bytes)
            if v % 3 == 0:
                continue  # the engine skips this version: the next brings two deltas
            until(v, receiver, engine)
            assert receiver_crc32(receiver) == cast_crc(trainer, torch.bfloat16), v
        folder = sorted(p.name for p in (tmp_path / "w").iterdir())
        assert folder == [
            "LATEST",
            "v10.delta.safetensors",
            "v5.safetensors",
            "v6.delta.safetensors",
            "v7.delta.safetensors",
            "v8.delta.safetensors",
            "v9.delta.safetensors",
            "v9.safetensors",
        ]
        assert fracs[0] == 1.0 and max(fracs[1:4]) < 0.5, fracs
        late_model, late = _files_engine(handle, tiny_dir)
        until(10, late, late_model)  # v9's full file, then v10's delta
        assert receiver_crc32(late) == cast_crc(trainer, torch.bfloat16)
        late.close()
    finally:
        receiver.close()
        publisher.close()


def test_a_damaged_delta_file_is_never_applied(tiny_dir, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    trainer = load_model(str(tiny_dir))
    handle = plan_transport(
        transport(kind="files", dir=str(tmp_path / "w"), dtype="bfloat16", delta=True, checksum=True), trainer, 1
    )
    publisher = open_publisher(handle)
    engine, receiver = _files_engine(handle, tiny_dir)
    publisher.publish(trainer, 1)
    assert receiver.maybe_update(engine) == 1
    before = receiver_crc32(receiver)
    nudge(trainer, STEP, seed=2)
    publisher.publish(trainer, 2)
    path = tmp_path / "w" / "v2.delta.safetensors"
    with safe_open(str(path), framework="pt") as f:
        payload, meta = f.get_tensor("flat"), f.metadata()
    payload[-1] ^= 1
    save_file({"flat": payload}, str(path), metadata=meta)
    with pytest.raises(TransportError, match="v2.delta.safetensors: delta failed its checksum"):
        receiver.maybe_update(engine)
    assert receiver.applied == 1 and receiver_crc32(receiver) == before
    publisher.close()


def test_broadcast_deltas_reach_another_process_bit_exact_and_a_rebuilt_group_gets_the_full_version(
    tiny_dir, spawn_child
):
    """Eight small updates by broadcast with deltas and checksums to an engine process: the first round and
    the one after an engine joins carry the full layout, the others a small fraction of it; every version's
    CRC on the engine equals the trainer's cast."""
    trainer = load_model(str(tiny_dir))
    cfg = transport(kind="broadcast", timeout_s=60, bucket_mb=0.01, dtype="bfloat16", delta=True, checksum=True)
    handle = plan_transport(cfg, trainer, num_engines=2, first_engines=1)
    publisher = open_publisher(handle)
    first = spawn_child(report_versions, handle, str(tiny_dir), "bfloat16", 1, 8)
    second = None
    fracs = {}
    try:
        publisher.connect()
        first.get("attached")
        for v in range(1, 9):
            if v == 5:
                second = spawn_child(report_versions, handle, str(tiny_dir), "bfloat16", 2, 8)
                second.get("attached")
            nudge(trainer, STEP, seed=v)
            publisher.publish(trainer, v)
            fracs[v] = publisher.sent_bytes / handle.total_bytes
            expected = cast_crc(trainer, torch.bfloat16)
            assert first.get("version") == (v, expected)
            if second is not None:
                assert second.get("version") == (v, expected)
        assert fracs[1] == fracs[5] == 1.0, fracs
        assert all(fracs[v] < 0.5 for v in (2, 3, 4, 6, 7, 8)), fracs
        assert publisher.replans == 1
    finally:
        codes = [c.join() for c in (first, second) if c is not None]
        publisher.close()
    assert codes == [0, 0]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the ray extra is not installed")
def test_a_run_on_ray_sends_deltas_by_broadcast_and_every_engine_ends_with_the_trainers_weights(tiny_dir, tmp_path):
    """The real CLI on a private Ray cluster with examples/weight_deltas.yaml's transport, runtime and
    overlapped publishes (two engines, broadcast, deltas, checksums; sends beside the next forward) on the
    tiny model at a small learning rate: the first publish carries the full version, every later one a
    fraction of it (publish_bytes_frac in the step records), and at the end both engines hold the
    trainer's weights bit for bit (summary.json's CRC32s)."""
    import yaml

    from support import ROOT
    from support.cli import nonstop, records, sets, small_model_args

    example = yaml.safe_load((ROOT / "examples" / "weight_deltas.yaml").read_text())
    overrides = {f"transport.{k}": v for k, v in example["transport"].items()}
    overrides |= {f"runtime.{k}": v for k, v in example["runtime"].items() if k != "ray_engine"}
    overrides["runtime.ray_engine.num_cpus"] = example["runtime"]["ray_engine"]["num_cpus"]
    overrides["trainer.publish_overlap"] = example["trainer"]["publish_overlap"]
    overrides |= {
        "engine.dtype": "bfloat16",  # weights travel in bfloat16, where small steps leave most bits alone
        "trainer.lr": "1e-5",
        "run.name": "deltas",
        "run.max_steps": 4,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 4,
        "rollout.max_new_tokens": 6,
        "rollout.filter_uniform_reward": False,
        "task.max_operand": 9,
        "task.eval_size": 8,
        "task.reward": "support.rewards:length_reward",
    }
    args = ["train", *small_model_args(tiny_dir), *sets(overrides)]
    result = nonstop(args, cwd=tmp_path, timeout_s=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "2 engine and 1 trainer actor(s) (ray backend)" in result.stdout
    run_dir = tmp_path / "runs" / "deltas"
    fracs = [r["publish_bytes_frac"] for r in records(run_dir)]
    assert len(fracs) == 4 and fracs[0] == 1.0 and all(0 < f < 0.8 for f in fracs[1:]), fracs
    weights = json.loads((run_dir / "summary.json").read_text())["weights_crc32"]
    assert weights["trainer"][0] == 4 and len(weights["engines"]) == 2
    assert all(e == weights["trainer"] for e in weights["engines"]), weights
