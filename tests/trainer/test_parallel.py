"""Data-parallel training: 2 gloo ranks (real processes) take the same step as 1 rank on the whole batch."""

from __future__ import annotations

import asyncio

import pytest
import torch

from nonstop.config import ConfigError, LocalRuntimeConfig, TrainerConfig, load_config
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.runtime import make_backend
from nonstop.trainer.core import Trainer
from nonstop.trainer.parallel import rendezvous, shard_bounds
from nonstop.types import GenerationRequest, Group, SamplingParams
from support.actor_classes import DataParallelRank

TEMPERATURE = 1.0
MAX_NEW_TOKENS = 10  # the longest request of _groups: the generation budget of dr_grpo's divisor
# One config per way the losses normalise: per-sample mean over samples with loss tokens, token
# mean (with clip-higher), the Dr.GRPO constant B x max_new_tokens, GSPO's per-sequence mean
# (with the unbiased group std), batch-normalised advantages, and the KL (clamped) / entropy
# terms that share the loss's divisor.
CONFIGS = {
    "grpo": TrainerConfig(lr=1e-2, clip_ratio_c=3.0),
    "dapo": TrainerConfig(lr=1e-2, loss="dapo", overlong_filter=False),  # random tiny models rarely stop
    "dr_grpo": TrainerConfig(lr=1e-2, loss="dr_grpo"),
    "gspo": TrainerConfig(lr=1e-2, loss="gspo", clip_eps=0.2, clip_eps_high=0.2, group_std="unbiased"),
    "reinforce_pp_kl_entropy": TrainerConfig(
        lr=1e-2, loss="reinforce_pp", kl_coef=0.1, kl_clamp=10.0, entropy_coef=0.01
    ),
}


def _groups(model_dir) -> tuple[list[Group], int]:
    """Five groups of four with mixed rewards and completions of different lengths (odd count:
    the ranks get unequal shares). Two samples have no loss token (as if environment-written),
    one on each rank's share of two ranks (groups 0-2 | 3-4): the 'sequence' and GSPO divisors
    must leave them out globally, not per rank."""
    tok = load_tokenizer(str(model_dir))
    engine = TorchEngine(load_model(str(model_dir)), [tok.eos_token_id], tok.pad_token_id)
    prompts = ["1+2=", "33+44=", "7+0=", "12+9=", "50+50="]
    reqs = [
        GenerationRequest(i, tok(p)["input_ids"], 4, SamplingParams(2 + 2 * i, TEMPERATURE, seed=i))
        for i, p in enumerate(prompts)
    ]
    groups = []
    for i, (p, samples) in enumerate(zip(prompts, engine.generate(reqs))):
        for j, s in enumerate(samples):
            s.reward = float((j + i) % 3 == 0) + 0.1 * j
        groups.append(Group(i, p, "x", samples))
    for g, j in ((1, 0), (3, 2)):
        s = groups[g].samples[j]
        s.loss_mask = [False] * len(s.completion_ids)
    assert len({len(s.completion_ids) for g in groups for s in g.samples}) > 1
    return groups, tok.pad_token_id


def test_shard_bounds_cover_every_group_once():
    for n in range(1, 12):
        for world in range(1, n + 1):
            spans = [shard_bounds(n, r, world) for r in range(world)]
            assert [i for lo, hi in spans for i in range(lo, hi)] == list(range(n))
            assert max(hi - lo for lo, hi in spans) - min(hi - lo for lo, hi in spans) <= 1


def test_two_gloo_ranks_take_the_one_rank_step_with_ddp_and_fsdp2(tiny_dir):
    """Both modes on one pair of rank processes (one process group), each config from the same start."""
    groups, pad = _groups(tiny_dir)

    async def two_ranks() -> dict[tuple[str, str], dict]:
        backend = make_backend(LocalRuntimeConfig())
        try:
            ranks = await asyncio.gather(
                *(backend.spawn(f"trainer-{r}", DataParallelRank, str(tiny_dir), pad) for r in range(2))
            )
            host, port = rendezvous("127.0.0.1")
            await asyncio.gather(*(a.call("join", host, port, r, 2) for r, a in enumerate(ranks)))
            out = {}
            for mode in ("ddp", "fsdp2"):
                for name, cfg in CONFIGS.items():
                    cfg = cfg.model_copy(update={"data_parallel": mode, "ranks": 2})
                    r0, r1 = await asyncio.gather(
                        *(a.call("step", cfg, groups, TEMPERATURE, MAX_NEW_TOKENS) for a in ranks)
                    )
                    out[mode, name] = r0
                    for k in r0["params"]:  # both ranks hold (or gather) the same full parameters
                        assert (r0["params"][k] == r1["params"][k]).all(), (mode, name, k)
            return out
        finally:
            await backend.shutdown()

    parallel = asyncio.run(two_ranks())
    for name, cfg in CONFIGS.items():
        torch.manual_seed(0)
        single = Trainer(load_model(str(tiny_dir)), cfg, TEMPERATURE, pad, max_new_tokens=MAX_NEW_TOKENS)
        initial = {n: p.detach().clone() for n, p in single.model.named_parameters()}
        metrics = single.step(groups)
        for mode in ("ddp", "fsdp2"):
            _same_step(parallel[mode, name], metrics, single, initial, f"{mode}/{name}")


def _same_step(got: dict, metrics: dict, single: Trainer, initial: dict, name: str) -> None:
    assert got["version"] == 1 and got["metrics"]["samples"] == metrics["samples"] == 20
    assert got["metrics"]["tokens"] == metrics["tokens"]
    assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-4, abs=1e-6), name
    # AdamW's first step hardly depends on the gradient's scale, so the global gradient norm
    # is what shows a wrong divisor; the parameters show a wrong direction.
    assert got["metrics"]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4), name
    moved, checked, total = 0.0, 0, 0
    for n, p in single.model.named_parameters():
        theirs = torch.from_numpy(got["params"][n])
        # A first Adam step moves element i by lr g_i / (|g_i| + 1e-8): ~lr (1e-2) wherever the
        # gradient is not ~0. Where |g_i| is at Adam's eps or below (float cancellation, ~1e-10),
        # summation-order noise decides a step of up to ~1e-4, so those elements are left out.
        # (The key bias has such gradients everywhere: attention is invariant to it.)
        live = p.grad.abs() > 1e-6
        dev = (theirs - p.detach()).abs()[live]
        assert bool((dev <= 5e-5).all()), (name, n, dev.max())
        checked, total = checked + dev.numel(), total + p.numel()
        moved = max(moved, float((p.detach() - initial[n]).abs().max()))
    assert moved > 5e-3, name  # the step changed the weights, so the comparison means something
    assert checked > 0.9 * total, (name, checked, total)


def test_more_ranks_than_groups_per_step_is_a_config_error():
    with pytest.raises(ConfigError, match=r"trainer.ranks \(5\) > rollout.prompts_per_step \(4\)"):
        load_config(overrides=["trainer.ranks=5", "rollout.prompts_per_step=4"])
    load_config(overrides=["trainer.ranks=2", "trainer.data_parallel=fsdp2"])  # checkpoints included (DCP)
    with pytest.raises(ConfigError, match="trainer.data_parallel"):
        load_config(overrides=["trainer.data_parallel=zero3"])


def test_two_rank_checkpoints_resume_where_they_stood_with_ddp_and_fsdp2(tiny_dir, tmp_path):
    """Two real TrainerWorker ranks train a step, checkpoint, and train another; two new ranks built
    from the checkpoint load it and train that same step: weights, optimizer state (FSDP2: each
    rank's shard, through torch.distributed.checkpoint) and the step after it are the original's."""
    from support.actor_classes import TrainerRankHost

    groups, pad = _groups(tiny_dir)

    async def run() -> dict:
        backend = make_backend(LocalRuntimeConfig())
        try:
            hosts = await asyncio.gather(*(backend.spawn(f"trainer-{r}", TrainerRankHost) for r in range(2)))

            async def each(method: str, *args) -> list:
                return list(await asyncio.gather(*(h.call("call", method, *args) for h in hosts)))

            async def start(model_path: str, cfg: TrainerConfig) -> None:
                host, port = rendezvous("127.0.0.1")
                await asyncio.gather(
                    *(h.call("make", model_path, cfg, pad, host, port, r, 2) for r, h in enumerate(hosts))
                )

            async def states() -> list:
                return list(await asyncio.gather(*(h.call("optimizer_state") for h in hosts)))

            out = {}
            for mode in ("ddp", "fsdp2"):
                cfg, ckpt = TrainerConfig(lr=1e-2, ranks=2, data_parallel=mode), tmp_path / mode
                await start(str(tiny_dir), cfg)
                await each("step", groups)
                await each("save_checkpoint", str(ckpt))
                saved = await states()
                await each("step", groups)
                await each("save", str(tmp_path / f"{mode}-continued"))
                await asyncio.gather(*(h.call("close") for h in hosts))

                await start(str(ckpt / "model"), cfg)
                versions = await each("load_checkpoint", str(ckpt))
                loaded = await states()
                await each("save", str(tmp_path / f"{mode}-loaded"))
                await each("step", groups)
                await each("save", str(tmp_path / f"{mode}-resumed"))
                await asyncio.gather(*(h.call("close") for h in hosts))
                out[mode] = versions, saved, loaded
            return out
        finally:
            await backend.shutdown()

    def params(folder) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in load_model(str(folder)).named_parameters()}

    for mode, (versions, saved, loaded) in asyncio.run(run()).items():
        assert versions == [1, 1], mode
        for rank in range(2):  # each rank's optimizer state (its shard with FSDP2) came back exactly
            assert saved[rank].keys() == loaded[rank].keys() and saved[rank], (mode, rank)
            for k, v in saved[rank].items():
                assert (loaded[rank][k] == v).all() if hasattr(v, "shape") else loaded[rank][k] == v, (mode, rank, k)
        tensors = [k for k, v in saved[0].items() if hasattr(v, "shape")]
        identical = all(saved[0][k].shape == saved[1][k].shape and (saved[0][k] == saved[1][k]).all() for k in tensors)
        assert identical == (mode == "ddp"), mode  # DDP ranks hold the same state, FSDP2 ranks their own shards
        state = torch.load(tmp_path / mode / "trainer.pt", weights_only=False)
        assert (state["optimizer"] is None) == (mode == "fsdp2"), mode
        assert (tmp_path / mode / "optimizer").is_dir() == (mode == "fsdp2"), mode
        ckpt, loaded_w = params(tmp_path / mode / "model"), params(tmp_path / f"{mode}-loaded")
        assert all(torch.equal(loaded_w[n], t) for n, t in ckpt.items()), mode
        continued, resumed = params(tmp_path / f"{mode}-continued"), params(tmp_path / f"{mode}-resumed")
        assert max(float((continued[n] - t).abs().max()) for n, t in ckpt.items()) > 1e-3, mode  # step 2 moved them
        for n, t in continued.items():
            assert torch.allclose(resumed[n], t, rtol=0, atol=1e-6), (mode, n, float((resumed[n] - t).abs().max()))
