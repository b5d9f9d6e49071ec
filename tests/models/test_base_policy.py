"""The shipped base policies and the choice of base: same bytes, same accuracy, clear errors."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nonstop.config import ConfigError, TaskConfig, load_config
from nonstop.engine.core import TorchEngine
from nonstop.models.base_policy import builds_warmup_base, choose_base, prepare_base_model
from nonstop.models.shipped import SHIPPED, read_provenance, sha256_file, shipped_dir, verify
from nonstop.models.tiny import make_char_tokenizer
from nonstop.models.warmup import greedy_accuracy
from nonstop.tasks.data import load_task
from support.cli import sets


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_shipped_base_loads_and_its_bytes_are_the_recorded_ones(kind):
    folder = shipped_dir(kind)
    prov = verify(folder)
    assert sha256_file(folder / "model.safetensors") == prov["sha256"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "qwen2" and model.config.hidden_size == prov["tiny"]["hidden_size"]
    assert tok("07+45=")["input_ids"] == make_char_tokenizer()("07+45=")["input_ids"]
    assert prov["command"].startswith("nonstop warmup") and prov["torch"] and prov["cpu_capability"]


@pytest.mark.parametrize("kind", sorted(SHIPPED))
def test_shipped_base_greedy_heldout_accuracy_is_the_recorded_one(kind):
    """Greedy decoding of a fixed checkpoint reproduces on any CPU unless two logits nearly tie.
    Rounding differences between kernels (batch 1 vs 500, 1 vs 2 threads) moved these logits by at
    most 7.6e-6. A prompt whose greedy path has a top-1 minus top-2 logit gap under 1e-4 anywhere
    is 'uncertain' (another CPU could flip it); the accuracy must match the recorded one up to
    the uncertain prompts: exactly for the shipped base (none), within 1/500 for the weak one."""
    folder = shipped_dir(kind)
    prov = verify(folder)
    data = load_task(
        TaskConfig(**{k: prov["task"][k] for k in ("name", "max_operand", "pad_answer", "split_seed", "eval_size")})
    )
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    acc = greedy_accuracy(
        TorchEngine(model, [tok.eos_token_id], tok.pad_token_id), tok, data.eval, prov["max_new_tokens"]
    )
    gaps = _greedy_gaps(model, tok, [ex.prompt for ex in data.eval], prov["max_new_tokens"])
    uncertain = int((gaps < 1e-4).sum())
    assert uncertain <= (0 if kind == "builtin" else 1), gaps.sort().values[:5]
    assert abs(acc - prov["heldout_accuracy"]) <= uncertain / len(data.eval) + 1e-9, (acc, prov["heldout_accuracy"])


@torch.no_grad()
def _greedy_gaps(model, tok, prompts: list[str], max_new: int) -> torch.Tensor:
    """Per prompt, the smallest top-1 minus top-2 logit gap along its greedy completion (B,)."""
    ids = torch.tensor([tok(p)["input_ids"] for p in prompts])  # the addition prompts share one length
    alive = torch.ones(len(prompts), dtype=torch.bool)
    gaps = torch.full((len(prompts),), float("inf"))
    for _ in range(max_new):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1]  # (B, V)
        top2 = logits.topk(2, dim=-1).values
        gaps = torch.where(alive, torch.minimum(gaps, top2[:, 0] - top2[:, 1]), gaps)
        nxt = logits.argmax(-1)
        alive &= nxt != tok.eos_token_id
        if not alive.any():
            break
        ids = torch.cat([ids, nxt.unsqueeze(-1)], -1)
    return gaps


def test_default_job_starts_from_the_shipped_base_whatever_the_run_seed(tmp_path):
    folders = {
        prepare_base_model(load_config(overrides=[f"run.seed={s}"]), data=None, log=lambda m: None) for s in range(5)
    }
    assert folders == {shipped_dir("builtin")}


def test_base_choice_follows_the_shape_the_task_and_the_fields():
    assert choose_base(load_config()) == "builtin"
    assert choose_base(load_config(overrides=["model.base=builtin_weak"])) == "builtin_weak"
    assert choose_base(load_config(overrides=["model.path=/some/model", "warmup.enabled=false"])) == "path"
    assert choose_base(load_config(overrides=["warmup.enabled=false"])) == "init"
    assert choose_base(load_config(overrides=["model.tiny.hidden_size=64"])) == "warmup"
    assert choose_base(load_config(overrides=["task.max_operand=49"])) == "warmup"
    assert choose_base(load_config(overrides=["task.split_seed=1"])) == "warmup"
    assert choose_base(load_config(overrides=["task.eval_size=600"])) == "warmup"  # would test on trained prompts
    assert choose_base(load_config(overrides=["task.eval_size=100"])) == "builtin"
    assert choose_base(load_config(overrides=["model.base=warmup"])) == "warmup"
    # an environment run starts from its environment's warm-up, the user's model.path aside
    assert choose_base(load_config(overrides=["env.name=guess_number"])) == "env"
    assert choose_base(load_config(overrides=["env.name=guess_number", "model.base=init"])) == "env"
    assert choose_base(load_config(overrides=["env.name=guess_number", "model.path=/some/model"])) == "path"
    assert not builds_warmup_base(load_config(overrides=["env.name=guess_number"]))
    with pytest.raises(ConfigError, match=r"model.base: the shipped base 'builtin' .*model.tiny.hidden_size is 64"):
        choose_base(load_config(overrides=["model.base=builtin", "model.tiny.hidden_size=64"]))
    with pytest.raises(ConfigError, match="model.base: 'init' applies to the tiny model only"):
        load_config(overrides=["model.base=init", "model.path=/some/model", "warmup.enabled=false"])
    with pytest.raises(ConfigError, match="model.base: 'warmup' contradicts warmup.enabled=false"):
        load_config(overrides=["model.base=warmup", "warmup.enabled=false"])


def test_warmup_command_writes_a_base_with_its_provenance(tmp_path):
    from support.cli import nonstop

    out = tmp_path / "base"
    small = sets(
        {
            "model.tiny.hidden_size": 32,
            "model.tiny.num_layers": 1,
            "model.tiny.num_heads": 2,
            "model.tiny.num_kv_heads": 1,
            "model.tiny.intermediate_size": 64,
            "task.max_operand": 9,
            "task.eval_size": 20,
            "warmup.max_steps": 20,
            "warmup.eval_every": 10,
            "warmup.seed": 4,
        }
    )
    result = nonstop(["warmup", *small, "--threads", "1", "--out", str(out)], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["sha256"] == sha256_file(out / "model.safetensors")
    assert prov["warmup_seed"] == 4 and prov["steps"] == 20 and len(prov["gate_curve"]) == 2
    assert prov["tiny"]["hidden_size"] == 32 and prov["task"]["max_operand"] == 9
    assert "--set warmup.seed=4" in prov["command"] and f"--out {out}" in prov["command"]
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    data = load_task(TaskConfig(max_operand=9, eval_size=20))
    acc = greedy_accuracy(TorchEngine(model, [tok.eos_token_id], tok.pad_token_id), tok, data.eval, 4)
    assert acc == prov["heldout_accuracy"]


def test_shipped_teacher_is_the_recorded_bytes_and_distill_teacher_builtin_names_it():
    """bench/distill.py and `distill.teacher: builtin` use the shipped teacher: the shipped base
    after RL, with the student's tokenizer, much stronger than the base (greedy held-out)."""
    from nonstop.config.scoring import SHIPPED_TEACHER
    from nonstop.scoring.teacher import check_tokenizers

    prov = verify(SHIPPED_TEACHER)
    base = read_provenance(shipped_dir())
    assert (
        prov["base_accuracy"] == base["heldout_accuracy"] and prov["heldout_accuracy"] >= base["heldout_accuracy"] + 0.3
    )
    assert load_config(overrides=["distill.teacher=builtin"]).distill.teacher == str(SHIPPED_TEACHER)
    check_tokenizers(str(shipped_dir("builtin_weak")), str(SHIPPED_TEACHER))  # raises if they differ
    data = load_task(
        TaskConfig(**{k: base["task"][k] for k in ("name", "max_operand", "pad_answer", "split_seed", "eval_size")})
    )
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_TEACHER).eval()
    tok = AutoTokenizer.from_pretrained(SHIPPED_TEACHER)
    acc = greedy_accuracy(TorchEngine(model, [tok.eos_token_id], tok.pad_token_id), tok, data.eval, 4)
    assert abs(acc - prov["heldout_accuracy"]) <= 3 / len(data.eval), (acc, prov["heldout_accuracy"])


def test_a_warmup_check_that_crosses_the_gate_replays_its_steps_to_the_first_that_crosses():
    """The gate is checked every tenth step; a check that crosses it sends the warm-up back to the
    check before and replays those steps one by one. It stops at the first of them at or above the
    target, with the weights a run that never went back has at that step."""

    target = 0.06

    def run(*overrides: str):
        model, _, info = _small_warmup("warmup.racers=1", *overrides)
        return model, info

    model, info = run(f"warmup.target_accuracy={target}", "warmup.max_steps=600", "warmup.eval_every=10")
    assert info["stopped"] == "gate" and info["gate_accuracy"] >= target
    # the same warm-up checked after every step, without a gate, to the check that crossed it
    last_check = -(-info["steps"] // 10) * 10
    _, every = run("warmup.target_accuracy=1.0", f"warmup.max_steps={last_check}", "warmup.eval_every=1")
    acc = dict(every["gate_curve"])
    crossing = min(s for s in acc if s % 10 == 0 and acc[s] >= target)
    assert info["steps"] == min(s for s in range(crossing - 9, crossing + 1) if acc[s] >= target)
    assert info["gate_accuracy"] == acc[info["steps"]]
    # and without going back, stopped at that step
    straight, _ = run("warmup.target_accuracy=1.0", f"warmup.max_steps={info['steps']}")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), straight.state_dict().values()))
    assert [s for s, _ in info["gate_curve"]] == [*range(10, crossing + 1, 10), *range(crossing - 9, info["steps"] + 1)]
    # warmup.replay_crossing=false (how the shipped bases were made) stops at the crossing check
    _, at_check = run(f"warmup.target_accuracy={target}", "warmup.eval_every=10", "warmup.replay_crossing=false")
    assert at_check["steps"] == crossing and at_check["gate_accuracy"] == acc[crossing]


def test_warmup_stops_at_its_time_limit_below_the_gate_and_says_so():
    """warmup.max_time_s (and by default half of run.max_total_s) ends a warm-up that has not
    reached its gate: the base is the model as it is, with why it stopped recorded."""
    from nonstop.models.warmup import warm_up
    from nonstop.tasks.data import load_task

    cfg = load_config(
        overrides=[
            "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1",
            "model.tiny.intermediate_size=64",
            "task.eval_size=20",
            "warmup.target_accuracy=1.0",
            "warmup.max_time_s=0.001",
            "warmup.racers=1",
        ]
    )
    _, _, info = warm_up(cfg, load_task(cfg.task), log=lambda m: None, threads=1)
    assert info["stopped"] == "max_time_s" and info["steps"] == 1 and len(info["gate_curve"]) == 1
    assert load_config(overrides=["run.max_total_s=300"]).warmup_time_limit_s == 150
    assert load_config(overrides=["run.max_total_s=300", "warmup.max_time_s=20"]).warmup_time_limit_s == 20
    assert load_config().warmup_time_limit_s is None


def test_a_warmup_race_keeps_the_racer_that_crosses_the_gate_in_the_fewest_steps():
    """warmup.racers=2: racer 0 (the warm-up seed) here and racer 1 (seed + 1000) in a spawned
    process. Without a margin, the kept base is the one of the two single warm-ups that crosses in
    fewer steps, with its weights, whichever process finished first. With warmup.race_margin, racer
    1 wins only by crossing that fraction earlier: a margin just wide enough keeps racer 0's base."""

    def run(*overrides: str):
        return _small_warmup("warmup.target_accuracy=0.06", "warmup.max_steps=600", *overrides)

    raced, _, info = run("warmup.racers=2", "warmup.race_margin=0")
    singles = {seed: run("warmup.racers=1", f"warmup.seed={seed}") for seed in (0, 1000)}
    steps = {seed: single[2]["steps"] for seed, single in singles.items()}
    assert all(single[2]["stopped"] == "gate" for single in singles.values())
    assert steps[1000] < steps[0] <= 2 * steps[1000], "racer 1 must cross first, within a margin of 1"
    assert (info["stopped"], info["seed"], info["steps"]) == ("gate", 1000, steps[1000])
    assert info["gate_curve"] == singles[1000][2]["gate_curve"]
    assert all(torch.equal(a, b) for a, b in zip(raced.state_dict().values(), singles[1000][0].state_dict().values()))
    loser = [r for r in info["racers"] if r["seed"] != 1000]
    # the loser went on until it could no longer win: it may be ahead in steps, and may even have
    # crossed the gate itself before racer 1 posted (racer 0 starts first, racer 1's process spawns)
    assert len(loser) == 1 and loser[0]["steps"] >= steps[1000]
    assert loser[0]["stopped"] == "beaten" or (loser[0]["stopped"] == "gate" and loser[0]["steps"] == steps[0])

    margin = math.ceil(1000 * (steps[0] / steps[1000] - 1)) / 1000  # racer 1's handicapped step >= racer 0's
    kept, _, info = run("warmup.racers=2", f"warmup.race_margin={margin}")
    assert (info["stopped"], info["seed"], info["steps"]) == ("gate", 0, steps[0])
    assert all(torch.equal(a, b) for a, b in zip(kept.state_dict().values(), singles[0][0].state_dict().values()))


def _small_warmup(*overrides: str):
    """A warm-up of a one-layer, 32-wide tiny model on addition, gated on 50 held-out prompts."""
    from nonstop.models.warmup import warm_up
    from nonstop.tasks.data import load_task

    cfg = _small_config(*overrides)
    return warm_up(cfg, load_task(cfg.task), log=lambda m: None, threads=1)


def _small_config(*overrides: str):
    """A one-layer, 32-wide tiny model on addition, gated on 50 held-out prompts."""
    return load_config(
        overrides=[
            "model.tiny.hidden_size=32",
            "model.tiny.num_layers=1",
            "model.tiny.intermediate_size=64",
            "task.eval_size=50",
            *overrides,
        ]
    )


def test_a_racer_beaten_while_it_replays_stops_where_it_can_no_longer_win_and_a_tie_goes_to_the_lower_racer():
    """The race's rule inside one racer: another racer's crossing is posted at the moment this one's
    check crosses the gate (before its replay). Posted a few steps before this racer's own first
    crossing, this racer stops there, beaten, with that step's accuracy (below the gate); posted at
    the same step by a higher racer, this racer wins the tie and stops at the gate."""
    import multiprocessing as mp

    from nonstop.models.tiny import make_char_tokenizer, make_tiny_model
    from nonstop.models.warmup import RaceBoard, _sft
    from nonstop.tasks.data import load_task

    gated = ("warmup.target_accuracy=0.06", "warmup.max_steps=600", "warmup.racers=1")
    _, _, single = _small_warmup(*gated)
    first, crossing_check = single["steps"], -(-single["steps"] // 10) * 10
    assert single["stopped"] == "gate"
    earlier = max(first - 3, crossing_check - 10)  # a step the single warm-up checked, below the gate

    def race_against(posted_step: int) -> dict:
        cfg = _small_config(*gated)
        board = RaceBoard(mp.get_context("spawn"))

        def log(line: str) -> None:
            if f"step {crossing_check}:" in line:
                board.post(posted_step, 1)

        model = make_tiny_model(cfg.model.tiny, 0)
        return _sft(model, make_char_tokenizer(), load_task(cfg.task), cfg, log, 0, time.perf_counter(), board, 0)

    beaten = race_against(earlier)
    assert (beaten["stopped"], beaten["steps"]) == ("beaten", earlier)
    assert beaten["gate_accuracy"] == dict(single["gate_curve"])[earlier] < 0.06
    tie = race_against(first)
    assert (tie["stopped"], tie["steps"], tie["gate_accuracy"]) == ("gate", first, single["gate_accuracy"])
