import torch

from nonstop.config import TrainerConfig, TransportConfig
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.trainer.core import Trainer
from nonstop.transport import open_sink, open_source, plan_transport
from nonstop.types import GenerationRequest, Group, SamplingParams


def _rollouts(engine, tok, prompts, n=4, temperature=0.8):
    reqs = [GenerationRequest(i, tok(p)["input_ids"], n, SamplingParams(5, temperature, seed=i)) for i, p in enumerate(prompts)]
    groups = []
    for i, (p, samples) in enumerate(zip(prompts, engine.generate(reqs))):
        for j, s in enumerate(samples):
            s.reward = float(j % 2)  # mixed rewards: non-zero advantages
        groups.append(Group(i, p, "x", samples))
    return groups


def test_on_policy_first_step_has_ratio_one_and_publishes_new_weights(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), temperature=0.8, pad_token_id=tok.pad_token_id)
    groups = _rollouts(engine, tok, ["1+2=", "33+44=", "7+0="])

    batch = trainer._batch(groups)
    with torch.no_grad():
        recomputed = trainer.logprobs(batch)
    m = batch["mask"]
    assert torch.allclose(recomputed[m], batch["behaviour"][m], atol=1e-4)

    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.step(groups)
    assert abs(metrics["ratio_max"] - 1) < 1e-4 and abs(metrics["ratio_min"] - 1) < 1e-4
    assert metrics["lag_hist"] == {"0": metrics["tokens"]}
    assert trainer.policy_version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))

    # the engine picks the new weights up through a real transport and stamps version 1
    handle = plan_transport(TransportConfig(kind="shm"), trainer.model, 1)
    sink = open_sink(handle)
    source = open_source(handle, engine.model)
    engine.weights = source
    try:
        sink.publish(trainer.model, trainer.policy_version)
        new_groups = _rollouts(engine, tok, ["5+5="])
        assert all(v == 1 for s in new_groups[0].samples for v in s.versions)
        with torch.no_grad():
            b2 = trainer._batch(new_groups)
            assert torch.allclose(trainer.logprobs(b2)[b2["mask"]], b2["behaviour"][b2["mask"]], atol=1e-4)
    finally:
        source.close()
        sink.close()


def test_step_raises_the_probability_of_rewarded_completions(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=3e-2), temperature=1.0, pad_token_id=tok.pad_token_id)
    groups = _rollouts(engine, tok, ["12+30="], n=6, temperature=1.0)
    batch = trainer._batch(groups)
    with torch.no_grad():
        before = (trainer.logprobs(batch) * batch["mask"]).sum(-1)
    for _ in range(5):
        trainer.step(groups)
    with torch.no_grad():
        after = (trainer.logprobs(batch) * batch["mask"]).sum(-1)
    adv = batch["advantages"]
    assert (after - before)[adv > 0].mean() > 0 > (after - before)[adv < 0].mean()
