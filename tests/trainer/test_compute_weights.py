"""The bf16 step's weights cast once per optimizer step (trainer/compute.py) against autocast alone.

Tolerances. The forward casts the same float32 weights to bfloat16 the same way, so the first step's
loss is bit for bit autocast's. The gradients of a weight read twice (the tied embedding and head) are
summed in float32 in another order, so later steps differ by float rounding amplified by AdamW: after
three steps at lr 1e-3 the weights agree within 2e-5 (max abs; the weights are ~0.02, one AdamW step
moves each by ~1e-3), and every loss within 1e-3 relative. The float32 path does not use these copies.
"""

from __future__ import annotations

import random

import pytest
import torch

from nonstop.config import TrainerConfig
from nonstop.trainer.compute import ComputeWeights
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import Group, Sample

WEIGHT_TOL = 2e-5
LOSS_RTOL = 1e-3


def groups(seed: int, G: int = 3, n: int = 4) -> list[Group]:
    """G groups of n samples with off-policy behaviour logprobs and mixed rewards (vocabulary 128)."""
    rng = random.Random(seed)
    out = []
    for g in range(G):
        prompt = [1] + [rng.randrange(3, 100) for _ in range(rng.randint(1, 6))]
        samples = []
        for _ in range(n):
            c = [rng.randrange(3, 100) for _ in range(rng.randint(1, 10))]
            lp = [-3.0 - rng.random() for _ in c]
            samples.append(Sample(prompt, c, lp, [0] * len(c), "stop", reward=float(rng.random() > 0.5)))
        out.append(Group(g, "", "", samples))
    return out


def worker(tiny_dir, cast_once: bool = True, **cfg) -> TrainerWorker:
    w = TrainerWorker(str(tiny_dir), TrainerConfig.model_validate({"lr": 1e-3, **cfg}), 1.0, 0, seed=0)
    if not cast_once:  # the step as it was: autocast alone
        w.compute = w.trainer.compute = None
    return w


def max_diff(a: TrainerWorker, b: TrainerWorker) -> float:
    pa, pb = dict(a.trainer.model.named_parameters()), dict(b.trainer.model.named_parameters())
    return max(float((pa[n] - pb[n]).detach().abs().max()) for n in pa)


def test_bf16_step_reads_weights_cast_once_per_step_and_learns_as_autocast_does(tiny_dir):
    new, old = worker(tiny_dir, precision="bfloat16"), worker(tiny_dir, precision="bfloat16", cast_once=False)
    assert new.compute is not None and old.compute is None
    linear_weights = [m.weight for m in new.trainer.model.modules() if isinstance(m, torch.nn.Linear)]
    for seed in range(3):
        a, b = new.step(groups(seed)).metrics, old.step(groups(seed)).metrics
        if seed == 0:
            assert a["loss"] == b["loss"]  # the same bf16 weights, the same arithmetic
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=LOSS_RTOL)
    assert new.compute.refreshes == 3  # once per optimizer step
    assert max_diff(new, old) < WEIGHT_TOL
    # outside the step the model holds its float32 masters; the copies hold their cast
    assert all(w.dtype == torch.float32 for w in linear_weights)
    for p in new.trainer.model.parameters():
        assert torch.equal(new.compute.copies[id(p)], p.detach().to(torch.bfloat16))


def test_micro_batches_and_a_forward_run_ahead_read_the_same_copies(tiny_dir):
    """A step over micro-batches, its first group's forward run ahead: with the copies and with autocast
    alone the same micro-batches give the same loss and the same gradients (each micro-batch's added in
    float32 into the masters), and the copies are cast once for the whole step."""
    from nonstop.trainer.micro import forward_tokens

    batch = groups(7)
    probe = worker(tiny_dir, precision="bfloat16")
    budget = max(forward_tokens([g], probe.trainer.layout()) for g in batch)  # every group fits, not two
    new, old = (worker(tiny_dir, c, precision="bfloat16", micro_batch_tokens=budget) for c in (True, False))
    grads = {}
    for name, w in (("new", new), ("old", old)):
        params = list(w.trainer.model.parameters())
        w.trainer.optimizer.register_step_pre_hook(
            lambda *_, n=name, ps=params: grads.update({n: [p.grad.clone() for p in ps]})
        )
        assert w.forward_ahead(batch[:1]).groups == 1
    a, b = new.step(batch).metrics, old.step(batch).metrics
    assert a["micro_batches"] == b["micro_batches"] > 1 and a["ahead_groups"] == 1
    assert a["loss"] == b["loss"]
    for ga, gb in zip(grads["new"], grads["old"]):
        assert float((ga - gb).abs().max()) <= 1e-6 * max(float(gb.abs().max()), 1.0)
    assert new.compute is not None and new.compute.refreshes == 1


@pytest.mark.parametrize("cast_once", [True, False])
def test_a_later_update_of_a_batch_reads_the_weights_the_first_update_left(tiny_dir, cast_once):
    """trainer.updates_per_batch 2 in bf16: the second update's forward must see the first update's
    weights. Autocast alone cached its casts for the whole region, and the second forward read the
    weights from before the first update: the same loss again, bit for bit."""
    w = worker(tiny_dir, cast_once=cast_once, precision="bfloat16", updates_per_batch=2, lr=1e-2)
    m = w.step(groups(1)).metrics
    assert m["updates"] == 2
    assert m["last_update_loss"] != m["loss"]


@pytest.mark.parametrize("cast_once", [True, False])
def test_a_forward_after_an_optimizer_step_in_the_same_autocast_region_reads_the_new_weights(tiny_dir, cast_once):
    """What the later updates of a batch rely on: after an optimizer step, a forward in the same autocast
    region equals one in a fresh region. Autocast alone kept its cached casts of the old weights."""
    w = worker(tiny_dir, cast_once=cast_once, precision="bfloat16", lr=1e-2)
    t = w.trainer
    batch = t.batch_of(groups(1))
    with w._precision():
        before = t.logprobs(batch)
        assert t.update(-(before * batch["mask"]).sum())[0] == 1
        after = t.logprobs(batch).detach()
    with w._precision():
        fresh = t.logprobs(batch).detach()
    assert not torch.equal(after, before.detach())
    assert torch.equal(after, fresh)


def test_fp32_step_uses_no_copies_and_clips_the_masters(tiny_dir):
    w = worker(tiny_dir, precision="float32")
    assert w.compute is None and w.trainer.compute is None
    w.step(groups(0))
    params = list(w.trainer.model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    expected = torch.nn.utils.clip_grad_norm_(params, 1e9)  # the clip as it was: over model.parameters()
    assert torch.equal(w.trainer.clip_grads(), expected)  # the same norm, bit for bit


def test_the_publish_sends_the_copies_and_the_engine_holds_the_trainers_cast(tiny_dir, tmp_path):
    """A bf16 trainer publishing in bfloat16 sends its copies (no cast at the publish); the transport
    re-homes them into its buffer once and every later refresh writes there; an engine's CRC32 equals
    the trainer's at every version."""
    from pydantic import TypeAdapter

    from nonstop.config import TransportConfig
    from nonstop.hf import load_model
    from nonstop.transport import open_receiver
    from nonstop.transport.base import receiver_crc32

    w = worker(tiny_dir, precision="bfloat16")
    cfg = TypeAdapter(TransportConfig).validate_python({"kind": "shm", "dtype": "bfloat16", "checksum": True})
    handle = w.plan_transport(cfg, 1)
    w.connect_transport()
    engine = load_model(str(tiny_dir), torch.bfloat16)
    receiver = open_receiver(handle, engine, 1)
    try:
        for seed in range(3):
            w.step(groups(seed))
            assert w.publish().policy_version == seed + 1
            assert receiver.maybe_update(engine) == seed + 1
            assert receiver_crc32(receiver) == w.weights_crc32()[1]
        assert w._publishable() is w.compute.published()
        assert isinstance(w.compute, ComputeWeights)
    finally:
        receiver.close()
        w.close()
