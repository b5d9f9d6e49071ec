"""verifiers (0.4.0, verifiers.v1) on nonstop's engines, with real calls: its train client renders,
bridges and POSTs to `/inference/v1/generate` (over HTTP on 127.0.0.1, and in process), its
message graph records the turns, and its episodes become nonstop samples in the buffer with the
engine's exact token ids, logprobs, versions and sampling masks. Skipped without the extra."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
import torch

vf = pytest.importorskip("verifiers.v1")

from test_episodes import NEW, Recording  # noqa: E402

from nonstop.config import ConfigError, EngineConfig, RolloutConfig, load_config  # noqa: E402
from nonstop.engine.aio import AsyncEngine  # noqa: E402
from nonstop.engine.core import TorchEngine  # noqa: E402
from nonstop.envs.base import ENV_VERSION, EnvLimits  # noqa: E402
from nonstop.envs.registry import builtin_task  # noqa: E402
from nonstop.envs.verifiers import client as vc  # noqa: E402
from nonstop.envs.verifiers import env as ve  # noqa: E402
from nonstop.envs.verifiers.tasks import AdditionData, AdditionTask  # noqa: E402
from nonstop.hf import load_model, load_tokenizer  # noqa: E402
from nonstop.observe.clock import Clock  # noqa: E402
from nonstop.orchestrator.buffer import RolloutBuffer  # noqa: E402
from nonstop.orchestrator.generate import Production, RolloutStats  # noqa: E402
from nonstop.orchestrator.ledger import Ledger  # noqa: E402
from nonstop.orchestrator.modes.environment.episode_flow import EnvRun, EpisodeStats, RoleBaselines, produce_episodes  # noqa: E402
from nonstop.orchestrator.modes.environment.episodes import encode_observation  # noqa: E402
from nonstop.tasks.codec import Codec  # noqa: E402
from nonstop.tasks.data import PromptStream  # noqa: E402
from support.served import serving  # noqa: E402

RETRY = " no "
ADDITION = "verifiers/nonstop.envs.verifiers.tasks:addition"


class RecordingServerEngine(AsyncEngine):
    """The real async engine behind the server, keeping what it sampled for each request."""

    def __init__(self, engine: TorchEngine) -> None:
        super().__init__(engine)
        self.calls: list = []

    def submit(self, request, queue=None):
        fut = super().submit(request, queue)
        fut.add_done_callback(lambda f: self.calls.append((list(request.prompt_ids), f.result()[0])))
        return fut


class ParityTask(AdditionTask):
    """Reward 1 for a reply of odd length: rewards that vary within a group, so advantages do too."""

    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply) % 2)


def _task(prompt="07+45=", answer="52", cls=AdditionTask):
    return cls(AdditionData(prompt=prompt, answer=answer))


def _check_exact(sample, calls, codec, retry_ids, top_k):
    """The sample is the first prompt, then per turn the engine's sample and (between turns) the
    retry message's ids; each turn asked the engine to continue exactly the sequence so far."""
    ids, mask = list(calls[0][0]), []
    assert sample.prompt_ids == codec.encode("07+45=") == ids
    for i, (prefix, s) in enumerate(calls):
        assert prefix == ids  # verifiers' bridge kept every earlier id as it was
        ids += s.completion_ids
        mask += [True] * len(s.completion_ids)
        if i < len(calls) - 1:
            ids += retry_ids
            mask += [False] * len(retry_ids)
    assert sample.prompt_ids + sample.completion_ids == ids and sample.loss_mask == mask
    served = [(t, lp, v) for _, s in calls for t, lp, v in zip(s.completion_ids, s.logprobs, s.versions)]
    kept = [
        (t, lp, v)
        for t, lp, v, m in zip(sample.completion_ids, sample.logprobs, sample.versions, sample.loss_mask)
        if m
    ]
    assert kept == served
    env = [t for t, m in enumerate(sample.loss_mask) if not m]
    assert all(sample.versions[t] == ENV_VERSION and sample.logprobs[t] == 0.0 for t in env)
    if top_k:
        masks = [list(m) for _, s in calls for m in s.sampling_mask]
        assert [m for m, keep in zip(sample.sampling_mask, sample.loss_mask) if keep] == masks
        assert all(len(m) == top_k for m in masks)
        assert all(sample.sampling_mask[t] == [sample.completion_ids[t]] for t in env)


def test_a_verifiers_episode_over_http_is_the_engine_samples_plus_the_env_messages(tiny_dir):
    """verifiers' TrainClient against `nonstop serve`'s /inference/v1/generate on 127.0.0.1: a
    three-turn episode (the random tiny model never adds right; each miss is answered)."""
    tok = load_tokenizer(str(tiny_dir))
    codec = Codec(tok)
    engine = TorchEngine(
        load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id, settings=EngineConfig(max_seq_len=64)
    )

    async def main():
        aio = RecordingServerEngine(engine)
        async with serving(aio, tok, "tiny") as base:
            client, log = vc.train_client(f"{base}/v1", str(tiny_dir))
            try:
                episode = await ve.play_episode(
                    client,
                    log,
                    _task(),
                    "tiny",
                    vf.SamplingConfig(temperature=1.0, max_tokens=3, top_k=4),
                    max_turns=3,
                    retry=RETRY,
                    tokenizer=tok,
                    max_episode_tokens=60,
                )
                async with httpx.AsyncClient() as http:
                    bad = await http.post(
                        f"{base}/inference/v1/generate",
                        json={"model": "tiny", "token_ids": [5, 6], "sampling_params": {"presence_penalty": 0.5}},
                    )
                    models = (await http.get(f"{base}/v1/models")).json()
                return aio.calls, episode, bad, models
            finally:
                await client.close()

    calls, episode, bad, models = asyncio.run(main())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.presence_penalty"
    assert models["data"][0]["max_model_len"] == 64
    trace = episode.traces[0]
    assert len(calls) == trace.num_turns == 3 and trace.stop_condition == "max_turns"
    assert episode.run.work.policy == vf.PolicySpan(start=0, end=0)
    [sample] = ve.episode_samples(episode, tok)
    _check_exact(sample, calls, codec, encode_observation(codec, RETRY), top_k=4)
    assert sample.reward == trace.reward == 0.0 and sample.role == "agent"
    # verifiers' own training view of the trace agrees: one branch, its ids, mask and logprobs
    [branch] = trace.branches
    assert branch.token_ids == sample.prompt_ids + sample.completion_ids
    assert branch.sampled_mask == [False] * len(sample.prompt_ids) + sample.loss_mask


def test_an_in_process_verifiers_episode_spanning_a_weight_update_carries_both_versions(tiny_dir):
    """The same client through `EngineTransport` (no socket) on a real engine that takes new weights
    after the first turn: the model tokens keep their versions, and the PolicySpan is 0..5."""
    tok = load_tokenizer(str(tiny_dir))
    codec = Codec(tok)
    new = load_model(str(tiny_dir))
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    rec = Recording(
        AsyncEngine(TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)),
        publish_after_first=new.state_dict(),
    )

    async def main():
        client, log = vc.train_client("http://nonstop.invalid/v1", str(tiny_dir), vc.EngineTransport(rec, "tiny"))
        try:
            return await ve.play_episode(
                client, log, _task(), "tiny", vf.SamplingConfig(temperature=1.0, max_tokens=3), max_turns=3, retry=RETRY
            )
        finally:
            await client.close()

    episode = asyncio.run(main())
    [sample] = ve.episode_samples(episode, tok)
    _check_exact(sample, rec.calls, codec, encode_observation(codec, RETRY), top_k=0)
    assert {v for v, m in zip(sample.versions, sample.loss_mask) if m} == {0, NEW} and sample.min_version == 0
    assert episode.run.work.policy == vf.PolicySpan(start=0, end=NEW)
    # an episode from elsewhere, without nonstop's per-token record: the span's oldest version, never younger
    del episode.traces[0].info[ve.VERSIONS_KEY]
    [old] = ve.episode_samples(episode, tok)
    assert {v for v, m in zip(old.versions, old.loss_mask) if m} == {0}


def test_verifiers_episodes_reach_the_buffer_as_groups_with_advantages(tiny_dir):
    """`VerifiersPlayer` as the producer's player: two task rows x two episodes, scored by the
    task's own @vf.reward, grouped, given GRPO advantages, settled in the ledger."""
    tok = load_tokenizer(str(tiny_dir))
    codec = Codec(tok)
    eng = AsyncEngine(TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id))
    tasks = [_task(f"{a:02d}+{b:02d}=", str(a + b), ParityTask) for a, b in ((7, 45), (12, 30))]
    player = ve.VerifiersPlayer(tasks, str(tiny_dir), retry=RETRY)
    cfg = load_config(None, ["env.name=guess_number"]).env
    rollout = RolloutConfig(prompts_per_step=2, group_size=3, filter_uniform_reward=False)
    ledger, stats, ep = Ledger(), RolloutStats(), EpisodeStats()
    buffer = RolloutBuffer(2, None, None, 64, ledger)

    async def main():
        await produce_episodes(
            Production(
                buffer,
                PromptStream(ve.task_rows(tasks, 0), seed=0, max_epochs=1),
                ledger,
                codec,
                rollout,
                Clock(),
                stats,
            ),
            eng,
            EnvRun(cfg, player, player, EnvLimits(2, 48, 3, 5.0), RoleBaselines("group", 0.9), ep),
        )
        return await buffer.take()

    groups = asyncio.run(main())
    assert len(groups) == 2 and ep.episodes == 6 and not ep.errors
    for g in groups:
        assert len(g.samples) == 3 and {s.episode for s in g.samples} == {0, 1, 2}
        rewards = [s.reward for s in g.samples]
        assert all(r in (0.0, 1.0) for r in rewards)
        mean = sum(rewards) / 3
        assert all((s.advantage > 0) == (s.reward > mean) for s in g.samples if s.reward != mean)
        for s in g.samples:
            assert (
                s.prompt_ids == codec.encode(g.prompt) and s.loss_mask[0] and all(v == 0 for v in s.versions if v >= 0)
            )
    assert ledger.report()["in_flight"] == 2


def test_verifiers_config_names_rows_and_errors(tiny_dir):
    cfg = load_config(None, [f"env.name={ADDITION}", "env.train_rows=40", "env.eval_rows=8"]).env
    data = builtin_task(cfg)
    assert len(data.train) == 40 and len(data.eval) == 8
    assert all(r.prompt.endswith("=") and len(r.prompt) == 6 for r in data.train + data.eval)
    assert [int(r.answer) for r in data.eval] == list(range(40, 48))
    run = EnvRun.build(cfg, tiny_dir)
    assert isinstance(run.play, ve.VerifiersPlayer) and run.baselines.mode == "group"
    with pytest.raises(ConfigError, match="env.name"):
        builtin_task(load_config(None, ["env.name=verifiers/nonstop.envs.verifiers.tasks"]).env)
    with pytest.raises(ConfigError, match="cannot import"):
        builtin_task(load_config(None, ["env.name=verifiers/nonstop.nothing_here:tasks"]).env)
    with pytest.raises(ConfigError, match="eval_name"):
        EnvRun.build(load_config(None, ["env.name=guess_number", f"env.eval_name={ADDITION}"]).env)
    assert Counter(type(t).__name__ for t in ve.taskset_tasks(ADDITION, 40, 8)[0]) == {"AdditionTask": 40}
