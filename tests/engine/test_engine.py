import pytest
import torch

from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.types import GenerationRequest, SamplingParams


@pytest.fixture()
def engine(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    return TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id), tok


def _full_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_behaviour_logprobs_are_those_of_the_tempered_distribution(engine):
    eng, tok = engine
    prompts = ["1+2=", "33+44=", "5=", "123+456="]  # ragged: exercises left padding
    reqs = [GenerationRequest(i, tok(p)["input_ids"], 3, SamplingParams(6, 0.7, seed=1)) for i, p in enumerate(prompts)]
    results = eng.generate(reqs)
    assert [len(r) for r in results] == [3, 3, 3, 3]
    for r in results:
        for s in r:
            assert len(s.completion_ids) == len(s.logprobs) == len(s.versions) == len(s.loss_mask)
            expected = _full_logprobs(eng.model, s.prompt_ids, s.completion_ids, 0.7)
            assert torch.allclose(torch.tensor(s.logprobs), expected, atol=1e-4)
            assert s.versions == [0] * len(s.completion_ids)


def test_batched_greedy_equals_one_by_one(engine):
    eng, tok = engine
    prompts = ["1+2=", "33+44=", "5=", "123+456=", "9+9="]
    params = SamplingParams(8, 0.0)
    batched = eng.generate([GenerationRequest(i, tok(p)["input_ids"], 1, params) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        alone = eng.generate([GenerationRequest(0, tok(p)["input_ids"], 1, params)])
        assert alone[0][0].completion_ids == batched[i][0].completion_ids


def test_eos_stops_a_row_and_sets_finish_reason(engine, tiny_dir):
    eng, tok = engine
    prompt = tok("1+1=")["input_ids"]
    first = eng.generate([GenerationRequest(0, prompt, 1, SamplingParams(5, 0.0))])[0][0].completion_ids[0]
    # an engine whose end-of-sequence token is the greedy first token stops right after it
    stopper = TorchEngine(load_model(str(tiny_dir)), [first], tok.pad_token_id)
    out = stopper.generate([GenerationRequest(0, prompt, 2, SamplingParams(5, 0.0))])
    assert all(s.finish_reason == "stop" and s.completion_ids == [first] for s in out[0])
    # the same greedy completion without an end-of-sequence token runs to max_new_tokens
    endless = TorchEngine(load_model(str(tiny_dir)), [], tok.pad_token_id)
    long = endless.generate([GenerationRequest(0, prompt, 1, SamplingParams(3, 0.0))])[0][0]
    assert long.finish_reason == "length" and len(long.completion_ids) == 3 and long.completion_ids[0] == first


class _SwapAfter:
    """A real weight receiver: loads `new_state` after `k` forward passes (between two passes)."""

    def __init__(self, new_state, k):
        self.new_state, self.k, self.calls = new_state, k, 0

    def maybe_update(self, model):
        self.calls += 1
        if self.calls == self.k + 1:
            model.load_state_dict(self.new_state)
            return 7
        return None


def _perturbed(tiny_dir):
    other = load_model(str(tiny_dir))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return other


def test_weights_swap_mid_sequence_and_later_tokens_carry_new_version(engine, tiny_dir):
    eng, tok = engine
    old = load_model(str(tiny_dir))
    eng.weights = _SwapAfter(_perturbed(tiny_dir).state_dict(), k=2)
    prompt = tok("12+34=")["input_ids"]
    s = eng.generate([GenerationRequest(0, prompt, 1, SamplingParams(6, 1.0, seed=0))])[0][0]
    assert len(s.completion_ids) >= 3, "needs tokens after the swap"
    assert s.versions[:2] == [0, 0] and all(v == 7 for v in s.versions[2:])
    assert eng.policy_version == 7
    # tokens before the swap keep the old weights' logprobs; later ones come from the new weights
    # (over the kept KV cache, so they match neither model's full recompute exactly)
    old_lp = _full_logprobs(old, prompt, s.completion_ids, 1.0)
    assert torch.allclose(torch.tensor(s.logprobs[:2]), old_lp[:2], atol=1e-4)
    assert not torch.allclose(torch.tensor(s.logprobs[2:]), old_lp[2:], atol=1e-2)


def test_weights_received_before_the_first_pass_apply_to_every_token(engine, tiny_dir):
    eng, tok = engine
    new = _perturbed(tiny_dir)
    eng.weights = _SwapAfter(new.state_dict(), k=0)
    prompt = tok("12+34=")["input_ids"]
    s = eng.generate([GenerationRequest(0, prompt, 1, SamplingParams(6, 1.0, seed=0))])[0][0]
    assert set(s.versions) == {7}
    assert torch.allclose(torch.tensor(s.logprobs), _full_logprobs(new, prompt, s.completion_ids, 1.0), atol=1e-4)


def _tempered_logits(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1 : -1] / temperature  # (C, V)


@pytest.mark.parametrize("kw", [{"top_k": 5}, {"top_p": 0.6}, {"min_p": 0.3}, {"top_k": 8, "top_p": 0.7}])
def test_sampling_mask_records_the_truncation_actually_applied(engine, kw):
    eng, tok = engine
    prompt = tok("21+13=")["input_ids"]
    params = SamplingParams(6, 0.8, seed=3, **kw)
    for s in eng.generate([GenerationRequest(0, prompt, 4, params)])[0]:
        assert s.sampling_mask is not None and len(s.sampling_mask) == len(s.completion_ids)
        scaled = _tempered_logits(eng.model, prompt, s.completion_ids, 0.8)
        for t, (kept, tok_id, lp) in enumerate(zip(s.sampling_mask, s.completion_ids, s.logprobs)):
            probs = torch.softmax(scaled[t], -1)
            order = probs.argsort(descending=True).tolist()
            if "top_k" in kw:
                assert set(kept) <= set(order[: kw["top_k"]])
            if kw.get("top_p") is not None and "top_k" not in kw:
                n = len(kept)
                assert set(kept) == set(order[:n])  # a prefix of the sorted distribution
                assert probs[order[: n - 1]].sum() < kw["top_p"] <= probs[order[:n]].sum() + 1e-6
            if "min_p" in kw:
                assert set(kept) == set((probs >= kw["min_p"] * probs.max()).nonzero().squeeze(-1).tolist())
            assert tok_id in kept
            # behaviour logprob: the tempered distribution renormalised over the kept set
            expected = scaled[t, tok_id] - torch.logsumexp(scaled[t, kept], -1)
            assert abs(lp - expected.item()) < 1e-4


def test_no_truncation_records_no_mask(engine):
    eng, tok = engine
    s = eng.generate([GenerationRequest(0, tok("1+1=")["input_ids"], 1, SamplingParams(3, 1.0))])[0][0]
    assert s.sampling_mask is None
