"""trainer.publish_overlap: the send of version v+1 goes on beside the next batch's forward, and the lag
accounting stays exact (docs/transport.md, "Publish overlapped with the next forward")."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch
from pydantic import TypeAdapter

from nonstop.config import TrainerConfig, TransportConfig
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import Group, Sample
from support.cli import nonstop, records, sets, small_model_args


def groups(seed: int) -> list[Group]:
    rng = random.Random(seed)
    out = []
    for g in range(2):
        prompt = [1] + [rng.randrange(3, 100) for _ in range(4)]
        samples = [
            Sample(prompt, c, [-3.0] * len(c), [0] * len(c), "stop", reward=float(i % 2))
            for i, c in enumerate([[rng.randrange(3, 100) for _ in range(6)] for _ in range(4)])
        ]
        out.append(Group(g, "", "", samples))
    return out


def test_the_worker_sends_on_its_thread_and_the_next_optimizer_step_waits_for_it(tiny_dir):
    """The first publish is inline (it binds the transport's buffer); later ones return `pending` at once,
    a forward runs ahead while the send goes on, `published()` gives the send's cost and bytes, the next
    step's optimizer step waits for the send (publish_wait_s), and the engine holds each version exactly."""
    from nonstop.hf import load_model
    from nonstop.transport import open_receiver
    from nonstop.transport.base import receiver_crc32

    cfg = TrainerConfig.model_validate({"lr": 1e-3, "publish_overlap": True, "precision": "bfloat16"})
    w = TrainerWorker(str(tiny_dir), cfg, 1.0, 0)
    transport = TypeAdapter(TransportConfig).validate_python({"kind": "files", "dtype": "bfloat16", "checksum": True})
    handle = w.plan_transport(transport, 1)
    w.connect_transport()
    engine = load_model(str(tiny_dir), torch.bfloat16)
    receiver = open_receiver(handle, engine, 1)
    try:
        w.step(groups(0))
        first = w.publish()
        assert not first.pending and first.publish_bytes == handle.total_bytes
        for seed in (1, 2, 3):
            metrics = w.step(groups(seed)).metrics
            assert metrics["publish_wait_s"] >= 0.0
            launched = w.publish()
            assert launched.pending and launched.policy_version == seed + 1 and launched.publish_bytes == 0
            assert w.forward_ahead(groups(seed + 10)).groups == 2  # beside the send
            sent = asyncio.run(w.published())
            assert not sent.pending and sent.policy_version == seed + 1 and sent.publish_bytes == handle.total_bytes
            assert receiver.maybe_update(engine) == seed + 1
            assert receiver_crc32(receiver) == w.weights_crc32()[1]
    finally:
        receiver.close()
        w.close()


def run(tiny_dir, tmp_path, name: str, extra: list[str]) -> list[dict]:
    overrides = [
        "trainer.publish_overlap=true",
        f"run.name={name}",
        "run.max_steps=6",
        "run.eval_every=3",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "rollout.max_new_tokens=6",
        "rollout.filter_uniform_reward=false",
        "task.max_operand=9",
        "task.eval_size=8",
        "task.reward=support.rewards:length_reward",
        "transport.checksum=true",
        *extra,
    ]
    result = nonstop(["train", *small_model_args(tiny_dir), *sets(overrides)], cwd=tmp_path)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    run_dir = tmp_path / "runs" / name
    summary = json.loads((run_dir / "summary.json").read_text())
    weights = summary["weights_crc32"]
    assert all(e == weights["trainer"] for e in weights["engines"]), weights  # every engine holds the last send
    return records(run_dir)


@pytest.mark.parametrize(
    "depth,max_lag,ahead",
    [(0, 0, "false"), ("null", 1, "true")],
)
def test_overlapped_publishes_keep_the_lag_accounting_exact(tiny_dir, tmp_path, depth, max_lag, ahead):
    """Depth 0: the next batch is generated only once the engines hold the new version, so every trained
    token has lag 0. An unbounded stream with max_lag 1 and forwards ahead (the max-lag rule is the only
    bound): the batch taken while the send is under way is checked against the version it trains at, so no
    token more than one version older is trained (the older groups are dropped; counted against the version
    before the send, lag 2 got through). Records come
    in step order, each with its send's bytes; those written after the send ended (no evaluation that
    step) carry the send's own time."""
    recs = run(
        tiny_dir,
        tmp_path,
        f"d{depth}",
        [f"buffer.depth={depth}", f"buffer.max_lag={max_lag}", f"trainer.forward_ahead={ahead}"],
    )
    assert [r["step"] for r in recs] == list(range(1, 7))
    assert [r["policy_version"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert set(r["lag_hist"]) <= {str(lag) for lag in range(max_lag + 1)}, (r["step"], r["lag_hist"])
        assert r["publish_bytes"] > 0 and r["publish_bytes_frac"] == 1.0
    assert any("publish_send_s" in r for r in recs), [sorted(r) for r in recs][:1]
    assert all("publish_wait_s" in r for r in recs)
