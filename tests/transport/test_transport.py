import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pydantic import TypeAdapter

from nonstop.config import BroadcastTransportConfig, FilesTransportConfig, ShmTransportConfig, TransportConfig
from nonstop.hf import load_model
from nonstop.transport import TransportError, check_layout, model_layout, open_publisher, open_receiver, plan_transport
from nonstop.transport.base import weights_crc32
from nonstop.types import FilesOptions
from support.weights import connect_then_hang, receive_weights, receive_weights_in
from support.weights import perturbed_model as _perturbed


def transport(**fields) -> TransportConfig:
    """The transport section `kind` selects, from its fields (as a config file gives them)."""
    return TypeAdapter(TransportConfig).validate_python(fields)


@pytest.mark.parametrize(
    "kind,extra",
    [
        ("shm", {}),
        ("broadcast", {}),
        ("files", {}),
        ("shm", {"checksum": True}),
        ("broadcast", {"per_tensor": True, "checksum": True}),
        ("files", {"checksum": True}),
        ("files", {"notify": "http"}),
    ],
)
def test_round_trip_exact_weights_across_processes(tiny_dir, kind, extra, spawn_child):
    trainer_model = load_model(str(tiny_dir))
    cfg = transport(kind=kind, timeout_s=60, **({"bucket_mb": 0.01} if kind == "broadcast" else {}), **extra)
    handle = plan_transport(cfg, trainer_model, num_engines=1)
    publisher = open_publisher(handle)
    child = spawn_child(receive_weights, handle, str(tiny_dir), 1, 2)
    try:
        publisher.connect()  # broadcast: rendezvous with the child; shm: nothing to do
        child.get("attached")
        published = _perturbed(tiny_dir, seed=1)
        publisher.publish(_perturbed(tiny_dir, seed=9), 1)
        publisher.publish(published, 2)
        seen, state = child.get("weights")
        assert seen[-1] == 2 and seen == sorted(seen)
        expected = published.state_dict()
        assert state.keys() == expected.keys()
        for name in expected:
            assert torch.equal(torch.from_numpy(state[name]), expected[name]), name
        assert len(handle.layout) == len(list(published.named_parameters()))  # tied weights sent once
    finally:
        exitcode = child.join()
        publisher.close()
    assert exitcode == 0


def test_shm_never_applies_a_slot_being_written_nor_overwrites_a_slot_in_use(tiny_dir):
    first, second = _perturbed(tiny_dir, seed=2), _perturbed(tiny_dir, seed=3)
    handle = plan_transport(ShmTransportConfig(), first, 1)
    publisher = open_publisher(handle)
    engine_model = load_model(str(tiny_dir))
    before = {k: v.clone() for k, v in engine_model.state_dict().items()}
    receiver = open_receiver(handle, engine_model)
    try:
        assert receiver.maybe_update(engine_model) is None  # nothing published yet
        publisher.publish(first, 1)
        slot = int(publisher.segment.stamps.tolist().index(1))
        publisher.segment.stamps[slot] = -1  # the writer is mid-way through the only version
        assert receiver.maybe_update(engine_model) is None
        assert all(torch.equal(before[k], v) for k, v in engine_model.state_dict().items())
        publisher.segment.stamps[slot] = 1
        assert receiver.maybe_update(engine_model) == 1
        assert torch.equal(engine_model.model.embed_tokens.weight, first.model.embed_tokens.weight)
        assert receiver.maybe_update(engine_model) is None  # same version is not applied twice
        # The engine keeps decoding with version 1 (zero copy: its weights live in the slot)
        # while the trainer publishes five more: the slot it reads is never written.
        for v in range(2, 7):
            publisher.publish(second if v % 2 else first, v)
            assert torch.equal(engine_model.model.embed_tokens.weight, first.model.embed_tokens.weight)
        assert receiver.maybe_update(engine_model) == 6
        receiver.close()  # the weights move back to private memory, still version 6
        assert torch.equal(engine_model.model.norm.weight, first.model.norm.weight)
    finally:
        publisher.close()


def test_shm_two_engines_on_different_versions_keep_their_slots_while_the_trainer_moves_on(tiny_dir):
    models = [_perturbed(tiny_dir, seed=s) for s in range(4)]
    handle = plan_transport(ShmTransportConfig(), models[0], num_engines=2)
    publisher = open_publisher(handle)
    engines = [load_model(str(tiny_dir)) for _ in range(2)]
    receivers = [open_receiver(handle, m, rank) for rank, m in ((1, engines[0]), (2, engines[1]))]
    try:
        publisher.publish(models[1], 1)
        assert receivers[0].maybe_update(engines[0]) == 1
        publisher.publish(models[2], 2)
        assert receivers[1].maybe_update(engines[1]) == 2
        for v in range(3, 9):  # 4 slots: the two claimed ones are never written
            publisher.publish(models[3], v)
        assert sorted(publisher.segment.claims.tolist()) == sorted([receivers[0].current, receivers[1].current])
        assert torch.equal(engines[0].model.embed_tokens.weight, models[1].model.embed_tokens.weight)
        assert torch.equal(engines[1].model.embed_tokens.weight, models[2].model.embed_tokens.weight)
        assert [s.maybe_update(m) for s, m in zip(receivers, engines)] == [8, 8]
        assert torch.equal(engines[0].model.norm.weight, models[3].model.norm.weight)
    finally:
        for s in receivers:
            s.close()
        publisher.close()
    with pytest.raises(TransportError, match=r"engine rank 3 outside 1..2"):
        open_receiver(handle, engines[0], 3)


def test_layout_mismatch_is_reported_by_name(tiny_dir):
    from nonstop.config import TinyModelConfig
    from nonstop.models.tiny import make_tiny_model

    layout, _ = model_layout(load_model(str(tiny_dir)))
    wider = make_tiny_model(
        TinyModelConfig(hidden_size=48, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    )
    with pytest.raises(
        TransportError,
        match=r"trainer and engine parameters differ: .*embed_tokens.weight: "
        r"trainer float32\[128, 32\] vs engine float32\[128, 48\]",
    ):
        check_layout(layout, wider)


def test_silent_broadcast_peer_times_out_with_a_clear_error(tiny_dir, spawn_child):
    model = load_model(str(tiny_dir))
    handle = plan_transport(BroadcastTransportConfig(timeout_s=3, rejoin_timeout_s=1), model, 1)
    publisher = open_publisher(handle)
    child = spawn_child(connect_then_hang, handle, str(tiny_dir), 1, daemon=True)
    try:
        publisher.connect()
        child.get("attached")
        t0 = time.monotonic()
        with pytest.raises(
            TransportError,
            match=r"((engine rank\(s\) 1 did not confirm version 1 within 3 s)|"
            r"(version 1 .*failed within 3 s)).*engine rank\(s\) 1 are gone and no replacement joined within 1 s",
        ):
            publisher.publish(model, 1)
        assert time.monotonic() - t0 < 3 + 1 + 3 + 10  # timeout, rejoin wait, one roll call
    finally:
        child.process.kill()


def test_broadcast_group_is_rebuilt_for_engines_that_replace_dead_ones(tiny_dir, spawn_child):
    """Rank 2 dies between two sends: the next send fails on it, waits for its replacement and
    goes out again in a rebuilt group. Rank 1 then leaves and its replacement attaches before the
    next send: that send rebuilds the group first. Every engine ends with the exact weights."""
    models = {v: _perturbed(tiny_dir, seed=v) for v in (1, 2, 3, 4)}
    handle = plan_transport(
        transport(kind="broadcast", timeout_s=30, bucket_mb=0.01, rejoin_timeout_s=120), models[1], num_engines=2
    )
    publisher = open_publisher(handle)
    first = spawn_child(receive_weights, handle, str(tiny_dir), 1, 3)
    doomed = spawn_child(receive_weights, handle, str(tiny_dir), 2, 4)
    try:
        publisher.connect()
        first.get("attached")
        doomed.get("attached")
        publisher.publish(models[1], 1)
        doomed.process.kill()
        doomed.process.join()
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(publisher.publish, models[2], 2)  # fails on the dead rank, then waits for a join
            time.sleep(0.5)  # let the send meet the dead peer first (that is the path under test)
            second = spawn_child(receive_weights, handle, str(tiny_dir), 2, 4)
            second.get("attached")
            sending.result(timeout=120)
        assert publisher.replans == 1
        publisher.publish(models[3], 3)
        seen, state = first.get("weights")  # rank 1 got 3 and leaves
        assert seen[-1] == 3 and all(
            torch.equal(torch.from_numpy(state[k]), t) for k, t in models[3].state_dict().items()
        )
        assert first.join() == 0
        third = spawn_child(receive_weights, handle, str(tiny_dir), 1, 4)
        third.get("attached")  # registered before the next send: it rebuilds the group first
        publisher.publish(models[4], 4)
        assert publisher.replans == 2
        for child in (second, third):
            seen, state = child.get("weights")
            assert seen[-1] == 4, seen
            for name, expected in models[4].state_dict().items():
                assert torch.equal(torch.from_numpy(state[name]), expected), name
    finally:
        publisher.close()


def test_broadcast_group_takes_an_engine_that_joins_after_the_start(tiny_dir, spawn_child):
    """Planned for two engine ranks with one at the start (a node with room for the second joins
    later): the first group is the trainer and rank 1 alone; rank 2 registers mid-run and the next
    send rebuilds the group with it as a new member. Both end with the exact weights."""
    models = {v: _perturbed(tiny_dir, seed=v) for v in (1, 2)}
    handle = plan_transport(
        transport(kind="broadcast", timeout_s=30, bucket_mb=0.01), models[1], num_engines=2, first_engines=1
    )
    publisher = open_publisher(handle)
    first = spawn_child(receive_weights, handle, str(tiny_dir), 1, 2)
    try:
        publisher.connect()  # does not wait for rank 2
        first.get("attached")
        publisher.publish(models[1], 1)
        assert publisher.members == [0, 1]
        joiner = spawn_child(receive_weights, handle, str(tiny_dir), 2, 2)
        joiner.get("attached")
        publisher.publish(models[2], 2)
        assert publisher.members == [0, 1, 2] and publisher.replans == 1
        sent = weights_crc32([t for _, t in models[2].named_parameters()])
        for child in (first, joiner):
            seen, state = child.get("weights")
            assert seen == ([1, 2] if child is first else [2]), seen
            for name, expected in models[2].state_dict().items():
                assert torch.equal(torch.from_numpy(state[name]), expected), name
            received = dict(state)
            got = weights_crc32([torch.from_numpy(received[n]) for n, _ in models[2].named_parameters()])
            assert got == sent
        assert weights_crc32([t for _, t in models[1].named_parameters()]) != sent
    finally:
        publisher.close()


@pytest.mark.slow  # ~20 s: four engine processes, one dying; the join alone is tested fast just above
def test_broadcast_tells_a_new_member_from_a_dead_members_replacement(tiny_dir, spawn_child):
    """Rank 2 dies while rank 3 joins (a node lost as another joins): the failed send's roll call
    finds rank 2 silent, the newcomer does not count as its replacement, and the send goes out
    once rank 2's replacement registered, in one new group holding all four: no group is built
    that waits on the dead rank."""
    models = {v: _perturbed(tiny_dir, seed=v) for v in (1, 2)}
    handle = plan_transport(
        transport(kind="broadcast", timeout_s=30, bucket_mb=0.01, rejoin_timeout_s=120, connect_timeout_s=60),
        models[1],
        num_engines=3,
        first_engines=2,
    )
    publisher = open_publisher(handle)
    first = spawn_child(receive_weights, handle, str(tiny_dir), 1, 2)
    doomed = spawn_child(receive_weights, handle, str(tiny_dir), 2, 2)
    try:
        publisher.connect()
        first.get("attached")
        doomed.get("attached")
        publisher.publish(models[1], 1)
        doomed.process.kill()
        doomed.process.join()
        joiner = spawn_child(receive_weights, handle, str(tiny_dir), 3, 2)
        joiner.get("attached")
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(publisher.publish, models[2], 2)
            time.sleep(0.5)  # let the send meet the dead peer first (that is the path under test)
            assert not sending.done()
            replacement = spawn_child(receive_weights, handle, str(tiny_dir), 2, 2)
            replacement.get("attached")
            sending.result(timeout=120)
        assert publisher.members == [0, 1, 2, 3] and publisher.generation == 1, (
            publisher.members,
            publisher.generation,
        )
        for child in (first, joiner, replacement):
            seen, state = child.get("weights")
            assert seen[-1] == 2, seen
            for name, expected in models[2].state_dict().items():
                assert torch.equal(torch.from_numpy(state[name]), expected), name
    finally:
        publisher.close()


def test_files_transport_applies_only_complete_versions_and_keeps_the_newest(tiny_dir, tmp_path):
    from nonstop.transport.files import MARKER

    trainer_model = _perturbed(tiny_dir, seed=4)
    handle = plan_transport(FilesTransportConfig(dir=str(tmp_path / "w"), keep=2), trainer_model, 1)
    publisher = open_publisher(handle)
    engine_model = load_model(str(tiny_dir))
    receiver = open_receiver(handle, engine_model)
    assert receiver.maybe_update(engine_model) is None  # no marker yet
    # a weights file without a marker (the writer died before the rename) is never applied
    (tmp_path / "w" / "v1.safetensors").write_bytes(b"partial")
    assert receiver.maybe_update(engine_model) is None
    for v in (1, 2, 3):
        publisher.publish(trainer_model, v)
    assert sorted(p.name for p in (tmp_path / "w").glob("v*.safetensors")) == ["v2.safetensors", "v3.safetensors"]
    assert (tmp_path / "w" / MARKER).read_text() == "3"
    # one mode for the folder: safetensors' own temporary file would leave the weights 0600
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "w").iterdir()} == {
        (tmp_path / "w" / MARKER).stat().st_mode & 0o777
    }
    assert receiver.maybe_update(engine_model) == 3
    assert torch.equal(engine_model.model.norm.weight, trainer_model.model.norm.weight)
    assert receiver.maybe_update(engine_model) is None


def test_corrupted_shm_slot_and_weights_file_are_rejected(tiny_dir, tmp_path):
    trainer_model = _perturbed(tiny_dir, seed=5)
    for kind, extra in (("shm", {}), ("files", {"dir": str(tmp_path / "w")})):
        handle = plan_transport(transport(kind=kind, checksum=True, **extra), trainer_model, 1)
        publisher = open_publisher(handle)
        engine_model = load_model(str(tiny_dir))
        before = engine_model.model.norm.weight.detach().clone()
        receiver = open_receiver(handle, engine_model)
        try:
            publisher.publish(trainer_model, 1)
            if kind == "shm":  # a flipped byte after the writer stamped the slot
                publisher.segment.slots[publisher.segment.stamps.tolist().index(1)][100] ^= 0xFF
            else:
                data = bytearray((tmp_path / "w" / "v1.safetensors").read_bytes())
                data[-10] ^= 0xFF
                (tmp_path / "w" / "v1.safetensors").write_bytes(bytes(data))
            with pytest.raises(TransportError, match="version 1 failed its checksum; not applied"):
                receiver.maybe_update(engine_model)
            assert torch.equal(engine_model.model.norm.weight, before)
            publisher.publish(trainer_model, 2)  # a clean version afterwards is applied
            assert receiver.maybe_update(engine_model) == 2
        finally:
            receiver.close()
            publisher.close()


def _tiny_moe():
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    cfg = Qwen2MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(cfg)


class _PerExpert(torch.nn.Module):
    """One expert as an engine written per expert holds it (and as checkpoints store it)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.up_proj = torch.nn.Linear(hidden, inter, bias=False)
        self.down_proj = torch.nn.Linear(inter, hidden, bias=False)


@pytest.mark.parametrize("kind", ["shm", "files"])
def test_fused_moe_experts_reach_a_per_expert_engine_as_stored_on_disk(tmp_path, kind):
    from safetensors import safe_open

    torch.manual_seed(0)
    trainer_model = _tiny_moe()  # transformers 5: experts fused, gate_up_proj (E, 2I, H), down_proj (E, H, I)
    trainer_model.save_pretrained(tmp_path / "ckpt")  # on disk: experts.{e}.{gate,up,down}_proj.weight
    engine_model = _tiny_moe()
    for layer in engine_model.model.layers:
        layer.mlp.experts = torch.nn.ModuleList([_PerExpert(32, 16) for _ in range(4)])
    handle = plan_transport(
        transport(kind=kind, **({"dir": str(tmp_path / "w")} if kind == "files" else {})), trainer_model, 1
    )
    assert "model.layers.0.mlp.experts.gate_up_proj" in {s.name for s in handle.layout}
    assert len(handle.layout) == len(list(trainer_model.parameters()))  # tied lm_head sent once
    publisher, receiver = open_publisher(handle), open_receiver(handle, engine_model)
    try:
        publisher.publish(trainer_model, 1)
        with torch.inference_mode():
            assert receiver.maybe_update(engine_model) == 1
        engine = engine_model.state_dict()
        with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), framework="pt") as disk:
            names = set(disk.keys())
            assert "model.layers.1.mlp.experts.3.up_proj.weight" in names
            for name in names:
                assert torch.equal(engine[name], disk.get_tensor(name)), name
        assert engine_model.lm_head.weight is engine_model.model.embed_tokens.weight
    finally:
        receiver.close()
        publisher.close()


def test_per_expert_engine_with_wrong_expert_shape_is_reported(tmp_path):
    trainer_model, engine_model = _tiny_moe(), _tiny_moe()
    engine_model.model.layers[0].mlp.experts = torch.nn.ModuleList([_PerExpert(32, 8) for _ in range(4)])
    handle = plan_transport(ShmTransportConfig(), trainer_model, 1)
    publisher = open_publisher(handle)
    try:
        with pytest.raises(
            TransportError, match=r"experts.0.gate_proj.weight: engine \[8, 32\] vs \[16, 32\] sliced from"
        ):
            open_receiver(handle, engine_model)
    finally:
        publisher.close()


def test_files_http_notification_loads_off_the_decode_path_and_survives_a_lost_trainer(tiny_dir, tmp_path):
    trainer_model = _perturbed(tiny_dir, seed=6)
    cfg = FilesTransportConfig(dir=str(tmp_path / "w"), notify="http", timeout_s=5)
    handle = plan_transport(cfg, trainer_model, 1)
    publisher = open_publisher(handle)
    engine_model = load_model(str(tiny_dir))
    receiver = open_receiver(handle, engine_model)
    publisher.publish(trainer_model, 1)
    deadline = time.monotonic() + 30
    while (applied := receiver.maybe_update(engine_model)) is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the watcher thread loads the file; maybe_update itself never waits
    assert applied == 1
    assert torch.equal(engine_model.model.norm.weight, trainer_model.model.norm.weight)
    publisher.close()  # a normal end: the watcher stops quietly
    receiver.thread.join(timeout=10)
    assert not receiver.thread.is_alive() and receiver.maybe_update(engine_model) is None
    assert receiver.notify_error is None
    # An engine whose trainer's server is gone records why, never hangs, and still gets the newest
    # version from the marker. The port is held by a socket that never listens (connections are
    # refused), so no other process can answer on it.
    import dataclasses
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as dead:
        dead.bind(("127.0.0.1", 0))
        assert isinstance(handle.options, FilesOptions) and handle.options.notify_at is not None
        notify_at = (handle.options.notify_at[0], dead.getsockname()[1])
        gone = dataclasses.replace(handle, options=dataclasses.replace(handle.options, notify_at=notify_at))
        orphan_model = load_model(str(tiny_dir))
        orphan = open_receiver(gone, orphan_model)
        orphan.thread.join(timeout=30)
        assert re.match(r"lost the trainer's notification server http://127.0.0.1:\d+/version", orphan.notify_error)
        assert orphan.maybe_update(orphan_model) == 1
        assert torch.equal(orphan_model.model.norm.weight, trainer_model.model.norm.weight)


@pytest.mark.parametrize("kind", ["shm", "files"])
def test_full_weights_travel_in_the_engines_dtype(tiny_dir, tmp_path, kind):
    """transport.dtype bfloat16: the float32 trainer casts as it writes, the slot or file holds half the
    bytes, and a bf16 engine in never_stop mode receives into its live model (no float32 staging copy)
    the very bits it would have cast itself; the checksums of both ends agree."""
    from nonstop.engine.core import TorchEngine
    from nonstop.transport.base import layout_dtype, receiver_crc32

    trainer_model = load_model(str(tiny_dir))
    extra = {"dir": str(tmp_path / "w")} if kind == "files" else {}
    full = plan_transport(transport(kind=kind, **extra), trainer_model, num_engines=1)
    handle = plan_transport(transport(kind=kind, dtype="bfloat16", **extra), trainer_model, num_engines=1)
    assert {s.dtype for s in full.layout} == {"float32"} and {s.dtype for s in handle.layout} == {"bfloat16"}
    assert layout_dtype(handle.layout) == torch.bfloat16
    params = sum(p.numel() for p in trainer_model.parameters())
    assert handle.total_bytes < full.total_bytes and handle.total_bytes >= 2 * params
    engine = TorchEngine(load_model(str(tiny_dir), torch.bfloat16), [], 0)
    engine.receive_weights_on(torch.device("cpu"), layout_dtype(handle.layout))
    assert engine.weight_model is engine.gate.live  # no staging copy
    publisher = open_publisher(handle)
    publisher.connect()
    receiver = open_receiver(handle, engine.weight_model, 1)
    engine.weights = receiver
    published = _perturbed(tiny_dir, seed=1)
    try:
        publisher.publish(published, 1)
        deadline = time.monotonic() + 30
        while engine.gate.poll() is None:
            assert time.monotonic() < deadline, "version 1 never arrived"
            time.sleep(0.01)
        engine.gate.apply()
        live = dict(engine.weight_model.named_parameters())
        for name, p in published.named_parameters():
            assert live[name].dtype == torch.bfloat16
            assert torch.equal(live[name], p.detach().to(torch.bfloat16)), name
        sent = weights_crc32(p.detach().to(torch.bfloat16) for _, p in published.named_parameters())
        assert receiver_crc32(receiver) == sent != weights_crc32(p.detach() for _, p in published.named_parameters())
    finally:
        receiver.close()
        publisher.close()


def test_broadcast_carries_bf16_weights_to_a_bf16_engine(tiny_dir, spawn_child):
    """The broadcast transport with transport.dtype bfloat16: the trainer casts into its send buffer,
    a bf16 engine in another process receives the same bits and the same checksum."""
    trainer_model = load_model(str(tiny_dir))
    cfg = transport(kind="broadcast", timeout_s=60, bucket_mb=0.01, dtype="bfloat16", checksum=True)
    handle = plan_transport(cfg, trainer_model, num_engines=1)
    publisher = open_publisher(handle)
    child = spawn_child(receive_weights_in, handle, str(tiny_dir), "bfloat16", 1, 1)
    try:
        publisher.connect()
        child.get("attached")
        published = _perturbed(tiny_dir, seed=1)
        publisher.publish(published, 1)
        version, crc, state = child.get("weights")
        assert version == 1
        expected = {n: p.detach().to(torch.bfloat16) for n, p in published.named_parameters()}
        for name, p in expected.items():
            assert torch.equal(torch.from_numpy(state[name]), p.float()), name
        assert crc == weights_crc32(expected.values())
    finally:
        exitcode = child.join()
        publisher.close()
    assert exitcode == 0
