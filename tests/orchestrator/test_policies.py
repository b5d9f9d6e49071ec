"""Separate policies per role (env.policies): each role's turns on its own policy's engine, each
sample tagged with its policy and delivered only to that policy's buffer, joint admission, a
ledger row settled once every policy settled its part; config refusals; and (slow) the real
pipeline with two trainers stepping and publishing independently."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from nonstop.config import ConfigError, RolloutConfig, config_reference, load_config
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.envs.base import EnvLimits
from nonstop.hf import load_model, load_tokenizer
from nonstop.observe.clock import Clock
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.generate import Production, RolloutStats
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.modes.environment.episode_flow import (
    EnvRun,
    EpisodeStats,
    RoleBaselines,
    env_player,
    produce_episodes,
)
from nonstop.orchestrator.modes.environment.episodes import RoleEngines
from nonstop.orchestrator.modes.own_policies.policy_build import check_roles, policy_config
from nonstop.orchestrator.modes.own_policies.split_intake import SplitIntake
from nonstop.tasks.codec import Codec
from nonstop.tasks.data import Example, PromptStream
from nonstop.types import GenerationRequest, Group, Sample
from support import EXAMPLES_DIR
from support.two_role_env import TURNS, Duel, duel_args

LIMITS = EnvLimits(max_turns=TURNS, max_episode_tokens=48, turn_max_tokens=3, step_timeout_s=5.0)
EXAMPLES = EXAMPLES_DIR / "envs"


class Counting:
    """A real in-process engine that keeps the prompt of every request it served."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine, self.prompts = engine, []

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        self.prompts += [r.prompt_ids for r in requests]
        return await self.engine.generate(requests)


def _engine(tiny_dir) -> Counting:
    tok = load_tokenizer(str(tiny_dir))
    return Counting(AsyncEngine(TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)))


def _drain(buffer: RolloutBuffer) -> list[Group]:
    out = []
    while buffer.queued:
        g = buffer.queue.get_nowait()
        if isinstance(g, Group):
            out.append(g)
    return out


def test_each_role_plays_its_own_policy_and_each_buffer_gets_only_its_part(tiny_dir):
    """Role 'b' has its own policy: its turns go only to its engine, its samples carry policy 'b'
    and reach only its buffer; role 'a' (the shared policy) likewise. The ledger settles a row only
    once both policies settled their part, as the part outcome or as both outcomes when they differ."""
    shared, own = _engine(tiny_dir), _engine(tiny_dir)
    codec = Codec(load_tokenizer(str(tiny_dir)))
    rows = [Example(i, "?", "") for i in range(4)]
    ledger = Ledger(("", "b"))
    buffers = {p: RolloutBuffer(4, None, None, 64, ledger.part(p)) for p in ("", "b")}
    rollout = RolloutConfig(prompts_per_step=4, group_size=2, filter_uniform_reward=False)
    asyncio.run(
        produce_episodes(
            Production(
                SplitIntake(buffers, False),
                PromptStream(rows, seed=0, max_epochs=1),
                ledger,
                codec,
                rollout,
                Clock(),
                RolloutStats(),
            ),
            RoleEngines(shared, {"b": own}),
            EnvRun(
                load_config(None, ["env.name=support.two_role_env:Duel"]).env,
                env_player(Duel),
                env_player(Duel),
                LIMITS,
                RoleBaselines("group", 0.9),
                EpisodeStats(),
            ),
        )
    )
    a_prompt, b_prompt = codec.encode("a?"), codec.encode("b?")
    assert len(shared.prompts) == len(own.prompts) == 4 * 2 * TURNS
    assert all(p[: len(a_prompt)] == a_prompt for p in shared.prompts)
    assert all(p[: len(b_prompt)] == b_prompt for p in own.prompts)
    parts = {p: _drain(b) for p, b in buffers.items()}
    for policy, role in (("", "a"), ("b", "b")):
        assert sorted(g.prompt_index for g in parts[policy]) == [0, 1, 2, 3]
        samples = [s for g in parts[policy] for s in g.samples]
        assert len(samples) == 4 * 2 and {(s.role, s.policy) for s in samples} == {(role, policy)}
        assert all(s.advantage is not None for s in samples)
    assert ledger.report()["in_flight"] == 4 and ledger.report()["settled"] == 0
    for g in parts[""]:
        buffers[""].settle(g, "trained")
    assert ledger.report()["settled"] == 0  # the own policy has not settled its part yet
    for g in parts["b"][:3]:
        buffers["b"].settle(g, "trained")
    asyncio.run(buffers["b"].drop(parts["b"][3], "max_lag"))
    buffers["b"].settle(parts["b"][0], "trained")  # a second settlement of a part: counted, never hidden
    report = ledger.report()
    assert report["settled"] == 4 and report["in_flight"] == 0 and report["duplicated"] == 1
    assert report["outcomes"] == {"trained": 3, "shared:trained+b:max_lag": 1}
    assert report["parts"] == {"shared:trained": 4, "b:trained": 3, "b:max_lag": 1}


def test_split_intake_admits_a_row_only_when_every_policy_admits_it():
    """Admission is joint: what a later buffer refuses is given back to the earlier ones; a refund
    and a part dropped in one buffer refund that buffer only."""
    a, b = RolloutBuffer(4, 0, None, 64), RolloutBuffer(4, 0, None, 64)
    intake = SplitIntake({"": a, "b": b}, filter_uniform=True)

    async def go() -> None:
        assert await b.admit(3) == 3  # b has room for one more row before its trainer steps
        assert await intake.admit(4) == 1
        assert (a.admitted - a.refunded, b.admitted - b.refunded) == (1, 4)
        await intake.refund(1)
        assert (a.admitted - a.refunded, b.admitted - b.refunded) == (0, 3)
        group = Group(
            0,
            "?",
            "",
            [
                Sample([1], [2], [-1.0], [0], "stop", role="a", advantage=1.0),
                Sample([1], [2], [-1.0], [0], "stop", role="b", policy="b", advantage=0.0),
            ],
        )
        await intake.put(group)
        assert a.queued == 1 and b.queued == 0 and b.drops == Counter({"uniform_reward": 1})

    asyncio.run(go())


def test_policies_config_names_its_field_for_each_refusal(tmp_path):
    base = ["env.name=nim", "env.policies.second.lr=0.001"]
    cfg = load_config(EXAMPLES / "nim_two_policies.yaml")
    assert cfg.env is not None and set(cfg.env.policies) == {"second"}
    check_roles(cfg, ("first", "second"))
    for extra, field in (
        (["distill.teacher=x"], "distill.teacher"),
        (["env.name=verifiers/nonstop.envs.verifiers.tasks:addition"], "env.name"),
        (["env.policies.second.pth=x"], "env.policies.second.pth"),
        (["trainer.ranks=2", "env.policies.second.lora=true"], "env.policies.second.lora"),
    ):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, base + extra)
    with pytest.raises(ConfigError, match=r"env\.policies\.third: .* no role 'third'"):
        check_roles(load_config(None, ["env.name=nim", "env.policies.third.lr=0.1"]), ("first", "second"))
    with pytest.raises(ConfigError, match="leave at least one role to the shared policy"):
        check_roles(load_config(None, [*base, "env.policies.first.lr=0.1"]), ("first", "second"))
    assert "`env.policies.<name>.path`" in config_reference()
    own = load_config(None, [*base, "env.policies.second.lora=true", "env.policies.second.num_engines=2"])
    assert own.env is not None
    seen = policy_config(own, own.env.policies["second"], 0, "second")  # what the own policy's actors are built from
    assert seen.model.lora.enabled and seen.trainer.lr == 0.001 and seen.runtime.num_engines == 2
    assert seen.run.seed != own.run.seed and not own.model.lora.enabled
    # once refused, now each combination is taken: each policy of a LoRA run trains adapters unless
    # it says otherwise, and each writes its files-transport versions in a folder of its own
    both = load_config(
        None,
        [
            *base,
            "model.lora.enabled=true",
            "runtime.backend=ray",
            "transport.kind=files",
            f"transport.dir={tmp_path}",
        ],
    )
    assert both.env is not None
    own_cfg = policy_config(both, both.env.policies["second"], 0, "second")
    assert own_cfg.model.lora.enabled and own_cfg.runtime.backend == "ray"
    assert load_config(None, [*base, "trainer.ranks=2", "rollout.prompts_per_step=2"]).trainer.ranks == 2
    assert own_cfg.transport.dir == str(tmp_path / "policy-second") != both.transport.dir
    full = load_config(None, [*base, "model.lora.enabled=true", "env.policies.second.lora=false"])
    assert full.env is not None and not policy_config(full, full.env.policies["second"], 0, "second").model.lora.enabled


def test_a_row_half_settled_at_a_checkpoint_goes_again_only_to_the_policies_that_had_not_settled():
    """The ledger keeps the parts settled of rows in flight across a checkpoint (JSON); after the
    resume the row is generated again and only the policy that had not settled its part gets it
    (the other's admission is refunded), so no part is trained twice and the row settles once."""
    from nonstop.tasks.data import Draw

    ledger = Ledger(("", "b"))
    ledger.draw(Draw(0, Example(7, "?", "")))
    ledger.part("").settle(0, 7, "trained")
    saved = json.loads(json.dumps(ledger.state_dict()))
    again = Ledger(("", "b"))
    again.load_state_dict(saved)
    again.draw(Draw(0, Example(7, "?", "")))  # the resume re-queues the in-flight row
    assert again.settled_parts(0, 7) == {"": "trained"}
    buffers = {p: RolloutBuffer(4, 0, None, 64, again.part(p)) for p in ("", "b")}
    intake = SplitIntake(buffers, filter_uniform=False, ledger=again)

    async def go() -> None:
        assert await intake.admit(1) == 1
        await intake.put(
            Group(
                7,
                "?",
                "",
                [
                    Sample([1], [2], [-1.0], [0], "stop", role=r, policy=p, advantage=1.0)
                    for r, p in (("a", ""), ("b", "b"))
                ],
            )
        )

    asyncio.run(go())
    assert buffers[""].queued == 0 and buffers[""].refunded == 1 and buffers["b"].queued == 1
    buffers["b"].settle(_drain(buffers["b"])[0], "trained")
    report = again.report()
    assert report["outcomes"] == {"trained": 1} and report["duplicated"] == 0 and report["in_flight"] == 0
    assert report["parts"] == {"shared:trained": 1, "b:trained": 1}


@pytest.mark.slow
def test_two_policies_train_their_own_roles_through_the_real_pipeline(tiny_dir, tmp_path):
    """Real engine and trainer processes of two policies, shm transports: role 'a' plays the shared
    policy, role 'b' its own. Both trainers step; each policy's version counts its own steps; each
    policy trained only its own role's samples (the orchestrator's tally and the trainer's count
    agree); every drawn row is settled once or in flight, with both parts settled."""
    from support.cli import nonstop

    out = nonstop(["train", *duel_args(tiny_dir, tmp_path, steps=4)], tmp_path, timeout_s=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run = tmp_path / "duel"
    s = json.loads((run / "summary.json").read_text())
    shared, own, ledger = s["policies"]["shared"], s["policies"]["b"], s["prompts"]
    assert s["steps"] == shared["steps"] == 4 and s["policy_version"] == shared["policy_version"] == 4
    assert own["steps"] >= 1 and own["policy_version"] == own["steps"]
    assert set(shared["samples_by_role"]) == {"a"} and set(own["samples_by_role"]) == {"b"}
    lines = [json.loads(x) for x in (run / "policies" / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in lines] == list(range(1, own["steps"] + 1))
    assert all(set(r["roles"]) == {"b"} for r in lines)
    assert sum(r["samples_trained"] for r in lines) == own["samples_by_role"]["b"]  # the trainer's count
    shared_lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in shared_lines if "samples_trained" in r]
    assert sum(r["samples_trained"] for r in steps) == shared["samples_by_role"]["a"]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4]
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0
    assert ledger["settled"] >= 4 * 4 and ledger["in_flight"] <= 2 * (1 + 1) * 4  # each buffer's window: depth 1
    parts = Counter({k.partition(":")[0]: 0 for k in ledger["parts"]})
    for k, v in ledger["parts"].items():
        parts[k.partition(":")[0]] += v
    assert parts["shared"] >= ledger["settled"] and parts["b"] >= ledger["settled"]
    assert (Path(own["final_dir"]) / "model.safetensors").exists() and 0.0 <= own["final_accuracy"] <= 1.0


@pytest.mark.slow
def test_a_run_with_two_policies_resumes_each_policy_from_its_checkpoint(tiny_dir, tmp_path):
    """A checkpoint holds every policy (the own one's trainer state under policies/<role>, its
    counters in state.json); a resumed run continues each policy's steps and versions where that
    policy was, not from 0, and the ledger still counts no duplicate and no unknown settlement."""
    from nonstop.checkpoint import latest_valid
    from support.cli import nonstop, sets

    out = nonstop(["train", *duel_args(tiny_dir, tmp_path, steps=2, checkpoint_every=2)], tmp_path, timeout_s=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run = tmp_path / "duel"
    ckpt = latest_valid(run / "checkpoints")  # the manifest covers policies/<role> too
    saved = ckpt.state["policies"]["own"]["b"]
    assert (ckpt.path / "policies" / "b" / "trainer.pt").exists() and saved["policy_version"] == saved["steps"]
    out = nonstop(["train", "--resume", str(run), *sets({"run.max_steps": 4})], tmp_path, timeout_s=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    s = json.loads((run / "summary.json").read_text())
    own, ledger = s["policies"]["b"], s["prompts"]
    assert s["resumed_from"] == str(ckpt.path) and s["policies"]["shared"]["steps"] == 4 and s["policy_version"] == 4
    assert own["steps"] >= saved["steps"] and own["policy_version"] == own["steps"]
    lines = [json.loads(x) for x in (run / "policies" / "b" / "metrics.jsonl").read_text().splitlines()]
    versions = [r["policy_version"] for r in lines]  # the first session may have stepped past its checkpoint
    resumed = (
        len(versions) - 1 - versions[::-1].index(saved["steps"] + 1) if own["steps"] > saved["steps"] else len(versions)
    )
    assert versions[resumed:] == list(range(saved["steps"] + 1, own["steps"] + 1))
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0 and ledger["requeued"] >= 0
    assert set(own["samples_by_role"]) == {"b"} and set(s["policies"]["shared"]["samples_by_role"]) == {"a"}


@pytest.mark.slow
def test_an_own_policy_trained_as_lora_adapters_sends_only_its_adapters(tiny_dir, tmp_path):
    """env.policies.b.lora: role b's policy trains LoRA adapters on its start weights; its engines
    keep those weights and its transport carries only the adapters (far fewer bytes than the shared
    policy's full weights); it steps on role b's samples only and writes an adapter folder."""
    from support.cli import nonstop, sets

    out = nonstop(
        [
            "train",
            *duel_args(
                tiny_dir,
                tmp_path,
                3,
                None,
                *sets({"env.policies.b.lora": True, "model.lora.rank": 2, "model.lora.alpha": 4}),
            ),
        ],
        tmp_path,
        timeout_s=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run = tmp_path / "duel"
    s = json.loads((run / "summary.json").read_text())
    own = s["policies"]["b"]
    assert s["policies"]["shared"]["steps"] == 3 and own["steps"] >= 1 and own["policy_version"] == own["steps"]
    assert set(own["samples_by_role"]) == {"b"}
    lines = [json.loads(x) for x in (run / "policies" / "b" / "metrics.jsonl").read_text().splitlines()]
    shared = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"publish_bytes"' in x]
    sent = [r["publish_bytes"] for r in lines if r["publish_bytes"]]
    assert sent and max(sent) * 4 < min(r["publish_bytes"] for r in shared if r["publish_bytes"])
    assert (Path(own["final_dir"]) / "adapter_config.json").exists()
