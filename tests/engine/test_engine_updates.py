"""Weight-update modes: which version each token carries and which weights its logprob comes from."""

import pytest
import torch
from transformers import DynamicCache

from nonstop.config import EngineConfig
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.types import GenerationRequest, SamplingParams

NEW = 7


class Publisher:
    """A real weight receiver the test drives: `publish()` makes new weights available; the engine
    receives them at its next poll (into whatever module it hands over)."""

    def __init__(self, state):
        self.state, self.ready, self.polls = state, False, 0

    def publish(self):
        self.ready = True

    def maybe_update(self, model):
        self.polls += 1
        if self.ready:
            self.ready = False
            model.load_state_dict(self.state)
            return NEW
        return None


def _setup(tiny_dir, mode, **kw):
    tok = load_tokenizer(str(tiny_dir))
    eng = TorchEngine(
        load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id, settings=EngineConfig(update_mode=mode, **kw)
    )
    new = load_model(str(tiny_dir))
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    pub = Publisher(new.state_dict())
    eng.weights = pub
    return eng, tok, load_model(str(tiny_dir)), new, pub


def _full(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _kept_cache(old, new, prompt, completion, k):
    """Logprobs of completion[k:] when the first k tokens were produced by `old` and the swap to
    `new` happened before token k: old KV for prompt + completion[:k-1], new weights after."""
    with torch.no_grad():
        cache = DynamicCache(config=old.config)
        old(torch.tensor([prompt + completion[: k - 1]]), cache=cache, use_cache=True)
        out = []
        for t in range(k - 1, len(completion) - 1):
            logits = new(torch.tensor([[completion[t]]]), cache=cache, use_cache=True).logits[0, -1]
            out.append(torch.log_softmax(logits, -1)[completion[t + 1]])
    return torch.stack(out)


def _run(eng, groups_before, publish_after_steps, groups_after=()):
    """Submit, step `publish_after_steps` times, publish, submit more, run to the end."""
    done = {}
    for name, req in groups_before:
        eng.submit(req, lambda s, name=name: done.__setitem__(name, s))
    for _ in range(publish_after_steps):
        eng.step()
    eng.weights.publish()
    for name, req in groups_after:
        eng.submit(req, lambda s, name=name: done.__setitem__(name, s))
    while eng.has_work():
        eng.step()
    return done


def _req(tok, text="12+34=", n=1, max_new=10):
    return GenerationRequest(0, tok(text)["input_ids"], n, SamplingParams(max_new, 1.0, seed=5, stop_token_ids=[]))


@pytest.mark.parametrize("mode", ["never_stop", "save_resume"])
def test_in_flight_sequences_keep_their_cache_and_later_tokens_use_new_weights(tiny_dir, mode):
    eng, tok, old, new, _ = _setup(tiny_dir, mode)
    req = _req(tok)
    s = _run(eng, [("a", req)], publish_after_steps=3)["a"][0]
    k = s.versions.index(NEW)
    assert k == 3 and s.versions == [0] * k + [NEW] * (len(s.versions) - k) and len(s.versions) > k + 2
    assert torch.allclose(torch.tensor(s.logprobs[:k]), _full(old, req.prompt_ids, s.completion_ids)[:k], atol=1e-4)
    expected = _kept_cache(old, new, req.prompt_ids, s.completion_ids, k)
    assert torch.allclose(torch.tensor(s.logprobs[k:]), expected, atol=1e-4)
    key = "paused_seqs" if mode == "save_resume" else "swaps"
    assert eng.scheduler.stats[key] >= 1 and eng.policy_version == NEW


def test_abort_retry_recomputes_the_cache_and_keeps_the_prefix_metadata(tiny_dir):
    eng, tok, old, new, _ = _setup(tiny_dir, "abort_retry")
    req = _req(tok, n=2)
    samples = _run(eng, [("a", req)], publish_after_steps=3)["a"]
    for s in samples:
        k = s.versions.index(NEW)
        assert k == 3 and s.versions == [0] * k + [NEW] * (len(s.versions) - k)
        # prefix tokens keep the old weights' logprobs; the rest match a full recompute under the new ones
        assert torch.allclose(torch.tensor(s.logprobs[:k]), _full(old, req.prompt_ids, s.completion_ids)[:k], atol=1e-4)
        assert torch.allclose(torch.tensor(s.logprobs[k:]), _full(new, req.prompt_ids, s.completion_ids)[k:], atol=1e-4)
    assert eng.scheduler.stats["aborted_seqs"] == 2


def test_drain_finishes_in_flight_requests_before_the_swap_and_holds_new_ones(tiny_dir):
    eng, tok, old, new, _ = _setup(tiny_dir, "drain")
    a, b = _req(tok, "1+2=", n=2), _req(tok, "40+2=")
    done = _run(eng, [("a", a)], publish_after_steps=2, groups_after=[("b", b)])
    for s in done["a"]:
        assert set(s.versions) == {0}
        assert torch.allclose(torch.tensor(s.logprobs), _full(old, a.prompt_ids, s.completion_ids), atol=1e-4)
    sb = done["b"][0]
    assert set(sb.versions) == {NEW}
    assert torch.allclose(torch.tensor(sb.logprobs), _full(new, b.prompt_ids, sb.completion_ids), atol=1e-4)


def test_blocking_admits_static_batches_and_swaps_only_between_them(tiny_dir):
    eng, tok, old, new, pub = _setup(tiny_dir, "blocking")
    a, b, c = _req(tok, "1+2=", max_new=4), _req(tok, "3+4=", max_new=9), _req(tok, "5+6=")
    polls = []
    done = {}
    for name, req in [("a", a), ("b", b)]:
        eng.submit(req, lambda s, name=name: done.__setitem__(name, s))
    eng.step()
    pub.publish()
    eng.submit(c, lambda s: done.__setitem__("c", s))
    while eng.has_work():
        polls.append(pub.polls)
        eng.step()
    # a and b form one batch: c waits although a's slot frees early, and no weights are polled meanwhile
    assert set(done["a"][0].versions) == set(done["b"][0].versions) == {0}
    assert set(done["c"][0].versions) == {NEW}
    assert polls.count(1) >= len(done["b"][0].completion_ids) - 1
    sc = done["c"][0]
    assert torch.allclose(torch.tensor(sc.logprobs), _full(new, c.prompt_ids, sc.completion_ids), atol=1e-4)


def test_group_cancel_restarts_groups_that_would_exceed_max_lag(tiny_dir):
    eng, tok, old, new, _ = _setup(tiny_dir, "never_stop", group_cancel=True, max_lag=0)
    req = _req(tok, n=3)
    samples = _run(eng, [("a", req)], publish_after_steps=2)["a"]
    assert eng.scheduler.stats["groups_cancelled"] == 1
    for s in samples:  # restarted from the prompt under the new weights: no stale token survives
        assert set(s.versions) == {NEW}
        assert torch.allclose(torch.tensor(s.logprobs), _full(new, req.prompt_ids, s.completion_ids), atol=1e-4)
    # a lag within the bound cancels nothing
    eng2, tok2, *_ = _setup(tiny_dir, "never_stop", group_cancel=True, max_lag=NEW)
    _run(eng2, [("a", _req(tok2))], publish_after_steps=2)
    assert eng2.scheduler.stats["groups_cancelled"] == 0


@pytest.mark.parametrize("mode", ["never_stop", "abort_retry", "save_resume", "drain", "blocking"])
def test_an_idle_engine_asked_what_it_decodes_with_applies_the_newest_version_first(tiny_dir, mode):
    eng, _, _, new, pub = _setup(tiny_dir, mode)
    eng.scheduler.apply_newest_if_idle()
    assert eng.policy_version == 0 and pub.polls == 1  # nothing published: the start weights stay
    pub.publish()
    eng.scheduler.apply_newest_if_idle()
    assert eng.policy_version == NEW
    assert all(torch.equal(a, b) for a, b in zip(eng.gate.live.state_dict().values(), new.state_dict().values()))


def test_a_busy_engine_is_not_swapped_by_the_idle_check(tiny_dir):
    eng, tok, *_, pub = _setup(tiny_dir, "drain")
    eng.submit(_req(tok, "12+3=", 2, 8), lambda s: None)
    eng.step()
    pub.publish()
    polls = pub.polls
    eng.scheduler.apply_newest_if_idle()
    assert eng.policy_version == 0 and pub.polls == polls and eng.has_work()
