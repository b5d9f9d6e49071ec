"""Keep Routing: the engine records MoE routes, the trainer compares and replays them."""

import copy
import re

import numpy as np
import pytest
import torch

from nonstop.config import EngineConfig, TinyModelConfig, TinyMoeConfig, TrainerConfig
from nonstop.engine.core import TorchEngine
from nonstop.kept import Routes
from nonstop.models.tiny import make_tiny_model
from nonstop.trainer.core import Trainer
from nonstop.trainer.routing import RouteShapeError
from nonstop.types import GenerationRequest, Group, SamplingParams
from support.cli import sets


def _moe(kind: str = "qwen3_moe", num_experts: int = 8, seed: int = 0):
    cfg = TinyModelConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        moe=TinyMoeConfig(kind=kind, num_experts=num_experts, expert_intermediate_size=64 if num_experts <= 8 else 4),
    )
    return make_tiny_model(cfg, seed=seed)


def _mixed_dense_moe():
    """A Qwen3-MoE whose middle layer is a dense MLP (mlp_only_layers)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        Qwen3MoeConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        )
    )


def _generate(model, groups: int = 6, n: int = 4, slots: int = 12):
    """Groups of n over fewer slots than they need together: later groups join running batches."""
    engine = TorchEngine(copy.deepcopy(model), [2], 0, settings=EngineConfig(max_concurrent_seqs=slots, max_seq_len=64))
    requests = [
        GenerationRequest(
            i, [1, 5 + i, 7, 9, 11 + i][: 3 + i % 3], n, SamplingParams(max_new_tokens=6, temperature=1.0, seed=i)
        )
        for i in range(groups)
    ]
    out = engine.generate(requests)
    if groups * n > slots:  # later groups were admitted into running batches
        assert engine.scheduler.stats["prefills"] > 1 and engine.scheduler.stats["decode_steps"] > 6
    return out


def _routes_array(r: Routes) -> np.ndarray:
    data = np.frombuffer(r.prompt + bytes(r.completion), dtype=np.uint8 if r.itemsize == 1 else "<u2")
    return data.reshape(-1, r.num_layers, r.top_k)


@pytest.mark.parametrize("kind,num_experts", [("qwen3_moe", 8), ("qwen2_moe", 8), ("qwen3_moe", 300), ("mixed", 6)])
def test_recorded_routes_equal_an_independent_hf_forward(kind, num_experts):
    model = _mixed_dense_moe() if kind == "mixed" else _moe(kind, num_experts)
    moe_layers = [layer for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    out = _generate(model)
    caught: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: caught.append(o[2])) for layer in moe_layers]
    checked = 0
    try:
        for samples in out:
            assert (
                samples[0].routes is not None and samples[0].routes.prompt is samples[1].routes.prompt
            )  # prefill shared
            for s in samples:
                r = s.routes
                k = moe_layers[0].mlp.gate.top_k
                assert (r.num_layers, r.top_k, r.num_experts) == (2, k, num_experts)
                assert r.itemsize == (1 if num_experts <= 256 else 2)
                assert r.num_prompt_tokens == len(s.prompt_ids)
                assert r.num_completion_tokens == len(s.completion_ids) - 1
                assert r.nbytes == (len(s.prompt_ids) + len(s.completion_ids) - 1) * 2 * k * r.itemsize
                caught.clear()
                with torch.no_grad():
                    logits = model(torch.tensor([s.prompt_ids + s.completion_ids[:-1]])).logits[0]
                hf = torch.stack(caught, dim=1).numpy()  # (tokens, layers, k)
                np.testing.assert_array_equal(np.sort(_routes_array(r), -1), np.sort(hf, -1))
                lp = torch.log_softmax(logits[len(s.prompt_ids) - 1 :], -1).gather(
                    -1, torch.tensor(s.completion_ids)[:, None]
                )
                torch.testing.assert_close(lp[:, 0], torch.tensor(s.logprobs), atol=1e-5, rtol=0)
                checked += 1
    finally:
        for h in hooks:
            h.remove()
    assert checked == 24


def _groups(out) -> list[Group]:
    groups = []
    for i, samples in enumerate(out):
        for j, s in enumerate(samples):
            s.reward = float(j % 2)
        groups.append(Group(i, "p", "a", samples))
    return groups


def _perturbed_router(model, noise: float):
    model = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.add_(noise * torch.randn(layer.mlp.gate.weight.shape, generator=g))
    return model


def _log_ratios(trainer: Trainer, groups: list[Group]) -> torch.Tensor:
    """log pi - log mu of every completion token in the trainer's forward, routes as configured."""
    batch = trainer.batch_of(groups)
    routes = batch["routes"]
    trainer.routing.arm(routes.reshape(-1, *routes.shape[2:]))
    try:
        with torch.no_grad():
            logp = trainer.logprobs(batch)
    finally:
        trainer.routing.disarm()
    return (logp - batch["behaviour"])[batch["mask"]]


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_replay_keeps_the_depth0_ratio_at_one_under_a_perturbed_router(kind):
    model = _moe(kind)
    groups = _groups(_generate(model))
    exact = Trainer(copy.deepcopy(model), TrainerConfig(routing_replay="r3"), 1.0, 0)
    assert _log_ratios(exact, groups).abs().max() < 1e-5  # same router, routes replayed: ratio 1

    free = Trainer(_perturbed_router(model, 1e-3), TrainerConfig(routing_replay="none"), 1.0, 0)
    kept = Trainer(_perturbed_router(model, 1e-3), TrainerConfig(routing_replay="r3"), 1.0, 0)
    free_ratio, kept_ratio = _log_ratios(free, groups), _log_ratios(kept, groups)
    assert free_ratio.abs().max() > 10 * kept_ratio.abs().max()
    assert kept_ratio.abs().max() < 2e-3  # what is left is the perturbation of the router weights itself

    m_free, m_kept = free.step(groups), kept.step(groups)
    assert m_free["routing_free_mismatch_frac"] > 0.02  # the perturbed router disagrees with the engine
    # read at the experts: without replay they compute with the free choice, under r3 with the engine's
    assert m_free["routing_replayed_frac"] == pytest.approx(1 - m_free["routing_free_mismatch_frac"])
    assert m_kept["routing_replayed_frac"] == 1.0
    # the free router is still measured under r3. Not to the same value: under r3 its later layers
    # see hidden states of the engine's earlier routes, without replay those of its own, and
    # attention carries an earlier token's different route into the states of the tokens after it
    assert m_kept["routing_free_mismatch_frac"] > 0.02
    assert m_kept["routing_free_mismatch_frac"] == pytest.approx(m_free["routing_free_mismatch_frac"], rel=0.25)
    assert m_kept["log_ratio_std"] < m_free["log_ratio_std"] / 10
    # replayed experts still train the router: its gradient flows through the gathered scores
    assert all(float(layer.mlp.gate.weight.grad.abs().sum()) > 0 for layer in kept.model.model.layers)


def test_replayed_frac_reads_the_experts_the_forward_computed_with():
    """A hook after the replay's that puts the router's free choice back: the experts compute with it,
    and routing_replayed_frac says so although trainer.routing_replay is r3."""
    model = _moe()
    groups = _groups(_generate(model))
    kept = Trainer(_perturbed_router(model, 1e-3), TrainerConfig(routing_replay="r3"), 1.0, 0)

    def undo(module, inputs, output):
        logits, _, _ = output
        weights, experts = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), module.top_k, -1)
        return logits, (weights / weights.sum(-1, keepdim=True)).to(logits.dtype), experts

    hooks = [layer.mlp.gate.register_forward_hook(undo) for layer in kept.model.model.layers]
    try:
        m = kept.step(groups)
    finally:
        for h in hooks:
            h.remove()
    assert m["routing_free_mismatch_frac"] > 0.02
    assert m["routing_replayed_frac"] == pytest.approx(1 - m["routing_free_mismatch_frac"])


def test_routes_that_do_not_fit_are_refused_by_name():
    model = _moe()
    groups = _groups(_generate(model, groups=2))
    trainer = Trainer(copy.deepcopy(model), TrainerConfig(routing_replay="r3"), 1.0, 0)
    s = groups[0].samples[0]
    good = s.routes
    s.routes = Routes(3, 2, 8, good.prompt, good.completion)
    with pytest.raises(
        RouteShapeError,
        match=re.escape(
            "sample.routes has 3 layers x top-2 of 8 experts, but the trainer's "
            "model has 2 routers (model.layers.0.mlp.gate ...)"
        ),
    ):
        trainer.step(groups)
    s.routes = Routes(2, 2, 8, good.prompt, good.completion[:-4])
    with pytest.raises(RouteShapeError, match="sample.routes covers"):
        trainer.step(groups)
    s.routes = None
    with pytest.raises(RouteShapeError, match="no routes recorded"):
        trainer.step(groups)
    assert trainer.policy_version == 0
    s.routes = good
    with pytest.raises(RouteShapeError, match=r"routes \[5, 2, 3\]: expected \(tokens, 2 layers, top-2\)"):
        trainer.routing.arm(torch.zeros((5, 2, 3), dtype=torch.long))  # k = 3 against top-2 routers
    with pytest.raises(
        ValueError, match="trainer.routing_replay: 'r3' replays MoE routes, but the model has no top-k router"
    ):
        Trainer(
            make_tiny_model(
                TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
            ),
            TrainerConfig(routing_replay="r3"),
            1.0,
            0,
        )


def test_each_layer_uses_its_routes_exactly_once():
    model = _moe()
    trainer = Trainer(copy.deepcopy(model), TrainerConfig(routing_replay="r3"), 1.0, 0)
    ids = torch.tensor([[1, 5, 7, 9]])
    routes = torch.full((4, 2, 2), -1, dtype=torch.long)
    trainer.routing.arm(routes)
    with torch.no_grad():
        trainer.model(ids)
        with pytest.raises(RuntimeError, match=r"model.layers.0.mlp.gate: recorded routes used twice"):
            trainer.model(ids)
    trainer.routing.arm(routes)
    with pytest.raises(RuntimeError, match=r"used \[0, 0\] times instead of once by model.layers.0.mlp.gate"):
        trainer.routing.disarm()
    trainer.routing.arm(torch.full((3, 2, 2), -1, dtype=torch.long))
    with (
        torch.no_grad(),
        pytest.raises(
            RouteShapeError,
            match=r"model.layers.0.mlp.gate: recorded routes \[3, 2\] for a router "
            r"that chose \[4, 2\]",
        ),
    ):
        trainer.model(ids)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from nonstop.models.tiny import save_tiny

    cfg = TinyModelConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        moe=TinyMoeConfig(
            kind="qwen2_moe", num_experts=4, expert_intermediate_size=16, shared_expert_intermediate_size=32
        ),
    )
    return save_tiny(tmp_path_factory.mktemp("moe"), cfg, seed=0)


@pytest.mark.parametrize("kind", ["shm", "files", pytest.param("broadcast", marks=pytest.mark.slow)])
def test_moe_weights_cross_every_transport(moe_dir, kind, spawn_child, tmp_path):
    """Fused experts, routers and the shared expert arrive bit-exact (broadcast: in an engine process)."""
    from pydantic import TypeAdapter

    from nonstop.config import TransportConfig
    from nonstop.hf import load_model
    from nonstop.transport import open_publisher, open_receiver, plan_transport
    from support.weights import receive_weights

    trainer_model = load_model(str(moe_dir))
    fields = {
        "kind": kind,
        "timeout_s": 60,
        **({"bucket_mb": 0.01} if kind == "broadcast" else {}),
        **({"dir": str(tmp_path / "w")} if kind == "files" else {}),
    }
    handle = plan_transport(TypeAdapter(TransportConfig).validate_python(fields), trainer_model, num_engines=1)
    assert "model.layers.1.mlp.experts.gate_up_proj" in {s.name for s in handle.layout}
    publisher = open_publisher(handle)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn(p.shape))
    try:
        if kind == "broadcast":  # a process group needs a second process
            child = spawn_child(receive_weights, handle, str(moe_dir), 1, 1)
            publisher.connect()
            child.get("attached")
            publisher.publish(trainer_model, 1)
            seen, state = child.get("weights")
            assert seen == [1] and child.join() == 0
            received = {k: torch.from_numpy(v) for k, v in state.items()}
        else:
            engine_model = load_model(str(moe_dir))
            receiver = open_receiver(handle, engine_model)
            publisher.publish(trainer_model, 1)
            with torch.inference_mode():
                assert receiver.maybe_update(engine_model) == 1
            received = {k: v.clone() for k, v in engine_model.state_dict().items()}  # shm: views of the segment
            receiver.close()
        for name, t in trainer_model.state_dict().items():
            assert torch.equal(received[name], t), name
    finally:
        publisher.close()


def test_engine_routes_with_the_experts_it_received(moe_dir):
    from nonstop.config import ShmTransportConfig
    from nonstop.hf import load_model
    from nonstop.transport import open_publisher, open_receiver, plan_transport

    trainer_model, engine_model = load_model(str(moe_dir)), load_model(str(moe_dir))
    engine = TorchEngine(engine_model, [2], 0, settings=EngineConfig(max_concurrent_seqs=8, max_seq_len=32))
    handle = plan_transport(ShmTransportConfig(), trainer_model, 1)
    publisher = open_publisher(handle)
    engine.weights = open_receiver(handle, engine.weight_model)
    try:
        with torch.no_grad():
            for layer in trainer_model.model.layers:  # new experts and router: different routes, different tokens
                layer.mlp.gate.weight.mul_(-3.0)
                layer.mlp.experts.gate_up_proj.add_(torch.randn(layer.mlp.experts.gate_up_proj.shape))
        publisher.publish(trainer_model, 1)
        [samples] = engine.generate(
            [GenerationRequest(0, [1, 5, 7], 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=3))]
        )
        assert all(v == 1 for s in samples for v in s.versions)
        caught: list[torch.Tensor] = []
        hooks = [
            layer.mlp.gate.register_forward_hook(lambda m, i, o: caught.append(o[2]))
            for layer in trainer_model.model.layers
        ]
        try:
            for s in samples:
                caught.clear()
                with torch.no_grad():
                    trainer_model(torch.tensor([s.prompt_ids + s.completion_ids[:-1]]))
                np.testing.assert_array_equal(
                    np.sort(_routes_array(s.routes), -1), np.sort(torch.stack(caught, 1).numpy(), -1)
                )
        finally:
            for h in hooks:
                h.remove()
    finally:
        engine.weights.close()
        publisher.close()


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["none", "r3"])
def test_pipeline_carries_routes_from_the_engine_process_to_the_trainer(moe_dir, tmp_path, replay):
    """`nonstop train` at depth 0 on a MoE: routes cross processes, metrics.jsonl has the MoE metrics."""
    import json

    from support.cli import nonstop

    result = nonstop(
        [
            "train",
            *sets(
                {
                    "model.path": moe_dir,
                    "warmup.enabled": False,
                    "run.progress": "plain",
                    "buffer.depth": 0,
                    "buffer.max_lag": 0,
                    "run.max_steps": 3,
                    "run.name": "moe",
                    "rollout.filter_uniform_reward": False,
                    "rollout.max_new_tokens": 6,
                    "rollout.prompts_per_step": 8,
                    "task.max_operand": 9,
                    "task.eval_size": 20,
                    "task.reward": "support.rewards:length_reward",
                    "trainer.routing_replay": replay,
                }
            ),
        ],
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    recs = [json.loads(line) for line in (tmp_path / "runs" / "moe" / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 3
    for r in recs:  # depth 0, one precision: the trainer routes as the engine did, ratio 1
        assert r["routing_free_mismatch_frac"] == 0.0 and r["routing_replayed_frac"] == 1.0, r
        assert r["log_ratio_std"] < 1e-4, r


class _DrivenReceiver:
    """A weight receiver the test drives: the engine loads `state` at its first poll after `publish()`."""

    def __init__(self, state):
        self.state, self.ready = state, False

    def maybe_update(self, model):
        if not self.ready:
            return None
        self.ready = False
        model.load_state_dict(self.state)
        return 1


def test_abort_retry_records_the_routes_recomputed_under_the_new_weights():
    model = _moe()
    new = _perturbed_router(model, 0.5)  # a router far enough from the old one to route differently
    engine = TorchEngine(
        copy.deepcopy(model),
        [2],
        0,
        settings=EngineConfig(max_concurrent_seqs=8, max_seq_len=32, update_mode="abort_retry"),
    )
    receiver = engine.weights = _DrivenReceiver(new.state_dict())
    done: list = []
    engine.submit(
        GenerationRequest(0, [1, 5, 7, 9], 4, SamplingParams(max_new_tokens=8, temperature=1.0, seed=0)), done.append
    )
    for _ in range(4):
        engine.step()
    receiver.ready = True
    while engine.has_work():
        engine.step()
    [samples] = done
    assert engine.scheduler.stats["aborted_seqs"] == 4
    caught: list[torch.Tensor] = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: caught.append(o[2])) for layer in new.model.layers]
    try:
        for s in samples:
            assert s.versions[:4] == [0] * 4 and set(s.versions[4:]) == {1}
            caught.clear()
            with torch.no_grad():
                new(torch.tensor([s.prompt_ids + s.completion_ids[:-1]]))
            # prompt and prefix were re-prefilled under the new weights: every route is theirs
            np.testing.assert_array_equal(
                np.sort(_routes_array(s.routes), -1), np.sort(torch.stack(caught, 1).numpy(), -1)
            )
    finally:
        for h in hooks:
            h.remove()


def test_engine_applies_qwen3_per_head_qk_norm():
    """Qwen3 (dense, and the attention of Qwen3-MoE) normalises queries and keys per head."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        Qwen3Config(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        )
    )
    with torch.no_grad():  # norms away from 1, so skipping them would show
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.2, 3.0)
            layer.self_attn.k_norm.weight.uniform_(0.2, 3.0)
    [samples] = TorchEngine(
        copy.deepcopy(model), [2], 0, settings=EngineConfig(max_concurrent_seqs=4, max_seq_len=32)
    ).generate([GenerationRequest(0, [1, 5, 7, 9], 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))])
    for s in samples:
        assert s.routes is None
        with torch.no_grad():
            logits = model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0]
        torch.testing.assert_close(lp, torch.tensor(s.logprobs), atol=1e-5, rtol=0)
