"""device / dtype placement (nonstop/device.py) as far as a CPU-only machine can check it: the
resolution rules and their errors, and the staged path a GPU or low-precision engine takes (host
float32 staging copy, copied and cast into the live model at the swap), here with a bfloat16 engine."""

from __future__ import annotations

import pytest
import torch

from nonstop.config import ConfigError, EngineConfig, ShmTransportConfig, load_config
from nonstop.device import DeviceError, attention, bf16_supported, resolve_device, resolve_dtype
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model
from nonstop.transport import open_publisher, open_receiver, plan_transport
from nonstop.types import GenerationRequest, SamplingParams


def test_device_resolution_and_its_errors():
    assert resolve_device("cpu", "engine.device") == torch.device("cpu")
    assert resolve_device("auto", "trainer.device").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype(None, torch.device("cpu"), "engine.dtype") == torch.float32  # unset: float32 on the CPU
    cpu_auto = torch.bfloat16 if bf16_supported(torch.device("cpu")) else torch.float32
    assert resolve_dtype("auto", torch.device("cpu"), "engine.dtype") == cpu_auto
    assert resolve_dtype("auto", torch.device("cuda"), "engine.dtype") == torch.bfloat16
    if not torch.cuda.is_available():
        with pytest.raises(
            DeviceError, match=r"trainer.device: 'cuda:1' but torch sees no CUDA device.*trainer.device: cpu"
        ):
            resolve_device("cuda:1", "trainer.device")
    with pytest.raises(ConfigError, match=r"engine.device"):
        load_config(None, ["engine.device=gpu0"])
    load_config(None, ["engine.device=cuda:3", "trainer.device=cpu", "engine.dtype=bfloat16"])  # resolved in the actor


@pytest.mark.parametrize("mode", ["never_stop", "abort_retry"])
def test_a_bfloat16_engine_takes_float32_weights_through_its_host_staging_copy(tiny_dir, mode):
    trainer_model = load_model(str(tiny_dir))
    engine = TorchEngine(
        load_model(str(tiny_dir), torch.bfloat16),
        [2],
        0,
        settings=EngineConfig(update_mode=mode, dtype="bfloat16", device="cpu"),
    )
    assert engine.gate.staged and engine.weight_model is not engine.model  # never_stop too: the live model is bf16
    assert next(engine.weight_model.parameters()).dtype == torch.float32
    handle = plan_transport(ShmTransportConfig(), trainer_model, 1)
    publisher = open_publisher(handle)
    receiver = open_receiver(handle, engine.weight_model)
    engine.weights = receiver
    try:
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.mul_(-1.5)
        publisher.publish(trainer_model, 1)
        out = engine.generate([GenerationRequest(0, [1, 5, 6], 2, SamplingParams(3))])
        assert all(v == 1 for s in out[0] for v in s.versions)
        live = dict(engine.model.named_parameters())
        for name, p in trainer_model.named_parameters():
            assert torch.equal(live[name], p.detach().to(torch.bfloat16)), name
    finally:
        receiver.close()
        publisher.close()


def test_half_precision_attention_on_the_cpu_is_float32_attention_cast_back():
    """With or without autocast around it: the float32 result of the same (bf16-valued) inputs, in bf16."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 5, 8, generator=g).bfloat16() for _ in range(3))
    mask = torch.ones(3, 1, 5, 5, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    got = attention(q, k, v, attn_mask=mask)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attention(q, k, v, attn_mask=mask), want.bfloat16())
    x = q.float()
    assert torch.equal(attention(x, k.float(), v.float(), attn_mask=mask), want)  # float32 is untouched
    # float32 inputs under autocast (the trainer's rotated queries and keys): autocast would run
    # the op in bf16 (its slow CPU backward, bf16-rounded scores); here it is float32, handed back
    # in autocast's dtype as the plain call would be
    qf, kf, vf = (torch.randn(3, 4, 5, 8, generator=g) for _ in range(3))
    exact = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attention(qf, kf, vf, attn_mask=mask), exact.bfloat16())
        assert not torch.equal(
            torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=mask), exact.bfloat16()
        )
