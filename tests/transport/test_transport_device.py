"""Device paths of the transports (transport/device.py) as far as the CPU can run them.

CUDA IPC and NCCL themselves need a GPU (bench/gpu_check.py checks them there). Here: the
choices (backend, mode, where the engine receives), the refusals, and the code the GPU paths
share with the CPU: the broadcast rendezvous that settles the backend between real processes,
the copying apply of the shm receiver under its claim, the buffers' placement.
"""

import dataclasses

import pytest
import torch
from pydantic import ValidationError

from nonstop.config import BroadcastTransportConfig, Config, ConfigError, ShmTransportConfig
from nonstop.engine.updates import WeightGate
from nonstop.hf import load_model
from nonstop.transport import TransportError, open_publisher, open_receiver, plan_transport
from nonstop.transport.base import FlatSender, engine_target
from nonstop.transport.device import IpcRecord, pick_backend, receive_device
from nonstop.transport.shm import NONE, ShmReceiver, _Segment
from support.weights import perturbed_model as _perturbed
from support.weights import receive_weights


def test_gpu_paths_asked_for_a_trainer_on_the_cpu_are_refused_naming_the_field(tiny_dir):
    model = load_model(str(tiny_dir))
    with pytest.raises(ConfigError, match=r"transport.device_path: 'ipc' .* trainer's weights are on cpu"):
        plan_transport(ShmTransportConfig(device_path="ipc"), model, 1)
    with pytest.raises(ConfigError, match=r"transport.device_path: 'nccl' .* trainer's weights are on cpu"):
        plan_transport(BroadcastTransportConfig(device_path="nccl"), model, 1)
    auto = plan_transport(ShmTransportConfig(), model, 1)  # auto on the CPU: the host slots only
    assert auto.options.device_path == "host"
    publisher = open_publisher(auto)
    try:
        assert publisher.segment.num_slots == publisher.segment.num_host == 3 and publisher.gpu_buffer is None
    finally:
        publisher.close()


@pytest.mark.parametrize(
    "section,message",
    [
        (
            {"transport": {"kind": "shm", "device_path": "ipc"}, "trainer": {"device": "cpu"}},
            r"transport.device_path: 'ipc' moves weights GPU to GPU, but trainer.device is 'cpu'",
        ),
        (
            {"transport": {"kind": "broadcast", "device_path": "nccl"}, "engine": {"device": "cpu"}},
            r"transport.device_path: 'nccl' moves weights GPU to GPU, but engine.device is 'cpu'",
        ),
        (
            {"transport": {"kind": "shm", "device_path": "ipc"}, "engine": {"kind": "vllm"}},
            r"transport.device_path: 'ipc' is not available with engine.kind 'vllm'",
        ),
    ],
)
def test_config_refuses_a_gpu_path_that_cannot_be(section, message):
    with pytest.raises(ValidationError, match=message):
        Config.model_validate(section)
    Config.model_validate({**section, "transport": {**section["transport"], "device_path": "auto"}})


def test_backend_and_receive_device_choices(tiny_dir):
    a, b, c = "cuda/GPU-a", "cuda/GPU-b", "cuda/GPU-c"
    assert pick_backend("auto", {0: a, 1: b, 2: c}) == "nccl"
    assert pick_backend("auto", {0: a, 1: "cpu"}) == "gloo"
    assert pick_backend("auto", {0: a, 1: a}) == "gloo"  # NCCL refuses two ranks on one GPU
    assert pick_backend("host", {0: a, 1: b}) == "gloo"
    assert pick_backend("nccl", {0: a, 1: b}) == "nccl"
    with pytest.raises(ConfigError, match=r"'nccl' needs every member's weights on CUDA, but engine rank 2 "):
        pick_backend("nccl", {0: a, 1: b, 2: "cpu"})
    with pytest.raises(ConfigError, match=r"'nccl' needs one GPU per member .* the trainer, engine rank 2 share one"):
        pick_backend("nccl", {0: a, 1: b, 2: a})
    handle = plan_transport(ShmTransportConfig(), load_model(str(tiny_dir)), 1)
    gpu_handle = dataclasses.replace(handle, options=dataclasses.replace(handle.options, device_path="auto"))
    cuda = torch.device("cuda", 0)  # a device object only: nothing is allocated on it
    assert receive_device(handle, cuda) is None  # host path: the engine keeps receiving on the host
    assert receive_device(gpu_handle, torch.device("cpu")) is None
    assert receive_device(gpu_handle, cuda) == cuda
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        IpcRecord.export(torch.zeros(4, dtype=torch.uint8))


def test_weight_gate_receives_into_the_live_model_or_a_float32_copy_on_the_asked_device(tiny_dir):
    live = load_model(str(tiny_dir))
    gate = WeightGate(live, staged_mode=False)
    assert gate.target is live  # float32 on the CPU, applied at once: no copy
    gate.receive_on(torch.device("cpu"))
    assert gate.target is live
    staged = WeightGate(live, staged_mode=True)
    assert staged.target is not live and next(staged.target.parameters()).device.type == "cpu"
    low = WeightGate(load_model(str(tiny_dir)).to(torch.bfloat16), staged_mode=False)
    assert next(low.target.parameters()).dtype == torch.float32  # transports write float32


def test_shm_copying_apply_holds_its_claim_only_for_the_copy(tiny_dir):
    """The apply a GPU engine uses (claim, copy into its own tensors, settle, release), run on host slots."""
    models = [_perturbed(tiny_dir, seed=s) for s in (1, 2, 3, 4, 5)]
    handle = plan_transport(ShmTransportConfig(), models[0], 1)
    publisher = open_publisher(handle)
    engine = load_model(str(tiny_dir))
    target = engine_target(engine, None, handle.layout)
    receiver = ShmReceiver(handle, handle.options, target, 1, apply="copy")
    own = {n: p.data_ptr() for n, p in engine.named_parameters()}
    try:
        publisher.publish(models[0], 1)
        assert receiver.maybe_update(engine) == 1
        assert publisher.segment.claims.tolist() == [NONE]  # nothing held after the copy
        assert {n: p.data_ptr() for n, p in engine.named_parameters()} == own  # its own memory, not the slot's
        for v, m in enumerate(models[1:], start=2):  # the trainer may now overwrite every slot, the engine keeps v1
            publisher.publish(m, v)
        for name, p in engine.named_parameters():
            assert torch.equal(p, dict(models[0].named_parameters())[name]), name
        assert receiver.maybe_update(engine) == 5 and receiver.copies == 2
        for name, p in engine.named_parameters():
            assert torch.equal(p, dict(models[4].named_parameters())[name]), name
        assert receiver.torn_reads == 0
    finally:
        receiver.close()
        publisher.close()


def test_shm_engine_that_cannot_map_the_gpu_slots_is_refused_under_ipc(tiny_dir):
    """A segment planned with GPU slots ('ipc'); an engine receiving on the CPU cannot map them."""
    model = load_model(str(tiny_dir))
    handle = plan_transport(ShmTransportConfig(), model, 1)
    opts = dataclasses.replace(handle.options, device_path="ipc", device="cuda:0")
    handle = dataclasses.replace(handle, options=opts)
    segment = _Segment(handle, opts, create=True)  # the header and host slots a GPU trainer's publisher makes
    try:
        assert segment.num_slots == segment.num_host + 2
        with pytest.raises(
            TransportError,
            match=r"transport.device_path 'ipc': engine rank 1 cannot map the "
            r"trainer's GPU slots: this engine receives its weights on cpu",
        ):
            open_receiver(handle, load_model(str(tiny_dir)), 1)
        auto = dataclasses.replace(handle, options=dataclasses.replace(opts, device_path="auto"))
        receiver = open_receiver(auto, load_model(str(tiny_dir)), 1)  # 'auto': attaches, says it did not map them
        assert segment.mapped.tolist() == [0]
        assert receiver.maybe_update(model) is None
        receiver.close()
    finally:
        segment.close(unlink=True)


def test_flat_sender_keeps_its_buffer_on_the_asked_device(tiny_dir):
    model = load_model(str(tiny_dir))
    handle = plan_transport(ShmTransportConfig(), model, 1)
    flat = FlatSender(handle, torch.device("cpu")).flat(model)
    assert flat.device.type == "cpu"
    first = next(model.parameters())
    assert flat.data_ptr() <= first.data_ptr() < flat.data_ptr() + flat.numel()  # re-homed: publish reads one block


def test_broadcast_rendezvous_settles_gloo_for_cpu_members(tiny_dir, spawn_child):
    trainer = _perturbed(tiny_dir, seed=7)
    handle = plan_transport(BroadcastTransportConfig(bucket_mb=0.01, timeout_s=60), trainer, 1)
    assert handle.options.device_path == "auto"
    publisher = open_publisher(handle)
    child = spawn_child(receive_weights, handle, str(tiny_dir), 1, 1)
    try:
        publisher.connect()
        child.get("attached")
        assert publisher.backend == "gloo" and publisher.store is not None
        assert publisher.store.get("device/1") == b"cpu" and publisher.store.get("backend") == b"gloo"
        publisher.publish(trainer, 1)
        seen, state = child.get("weights")
        assert seen == [1]
        for name, t in trainer.state_dict().items():
            assert torch.equal(torch.from_numpy(state[name]), t), name
    finally:
        assert child.join() == 0
        publisher.close()


def test_broadcast_refusal_reaches_the_engines(tiny_dir, spawn_child):
    """'nccl' from a (stated) GPU trainer with an engine on the CPU: the trainer refuses at the
    rendezvous, naming the field and the rank, and the engine's attach fails with the same words."""
    model = load_model(str(tiny_dir))
    handle = plan_transport(BroadcastTransportConfig(timeout_s=30, connect_timeout_s=60), model, 1)
    opts = dataclasses.replace(handle.options, device_path="nccl", device="cuda:0", member="cuda/GPU-trainer")
    handle = dataclasses.replace(handle, options=opts)  # as a trainer on a GPU plans it
    publisher = open_publisher(handle)
    child = spawn_child(receive_weights, handle, str(tiny_dir), 1, 1)
    try:
        with pytest.raises(ConfigError, match=r"'nccl' needs every member's weights on CUDA, but engine rank 1"):
            publisher.connect()
        assert child.join() != 0  # its attach raised
    finally:
        publisher.close()
