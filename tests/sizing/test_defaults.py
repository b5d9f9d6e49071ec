"""Defaults that follow from the run (sizing/defaults.py): the built-in engine's KV cache is sized
from the run's need and a memory budget, and trainer.lr follows its rule for loaded models while
the default job keeps its own value."""

from __future__ import annotations

import json

import pytest

from nonstop.config import EngineConfig, TrainerConfig, load_config
from nonstop.engine.core import TorchEngine
from nonstop.engine.scheduler import RequestError
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.tiny import make_char_tokenizer
from nonstop.orchestrator.fit import fit_run
from nonstop.orchestrator.launch import run_rows
from nonstop.sizing.defaults import engine_limits, engine_slots, learning_rate
from nonstop.sizing.machine import GIB, MachineMemory
from nonstop.types import GenerationRequest, SamplingParams
from support.cli import sets

MACHINE = MachineMemory(total=64 * GIB, available=48 * GIB, source="a stated test machine")


def short_run(tiny_dir, *extra: str):
    cfg = load_config(
        None,
        [f"model.path={tiny_dir}", "warmup.enabled=false", "rollout.max_new_tokens=5", "rollout.group_size=4", *extra],
    )
    return fit_run(cfg, run_rows(cfg), machine=MACHINE)


def test_engine_of_a_run_allocates_its_cache_from_need(tiny_dir):
    """Prompts of 6 tokens ('07+45='), 5 new tokens: 11 positions per slot, not the model's 128."""
    fitted = short_run(tiny_dir)
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(
        load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id, settings=fitted.cfg.engine_settings
    )
    runner = engine.runner
    assert (runner.num_slots, runner.max_seq_len) == (256, 6 + 5)
    assert tuple(runner.k[0].shape) == (256, 1, 11, 16) and len(runner.k) == len(runner.v) == 1
    kv = next(i for p in fitted.plan.procs for i in p.items if (p.name, i.name) == ("engine", "kv_cache"))
    assert runner.cache_bytes == kv.bytes == 256 * 11 * 2 * 16 * 4  # the plan is what the engine allocates
    prompt = tok("07+45=")["input_ids"]
    done = engine.generate([GenerationRequest(0, prompt, 4, SamplingParams(5, 1.0, seed=3))])
    assert len(done[0]) == 4 and all(len(s.completion_ids) <= 5 for s in done[0])
    with pytest.raises(RequestError, match="exceeds the engine's max_seq_len of 11 tokens"):
        engine.generate([GenerationRequest(1, tok("107+45=")["input_ids"], 1, SamplingParams(5, 1.0))])


def test_a_cache_sized_from_need_samples_exactly_what_the_full_cache_does(tiny_dir):
    """The default job's numbers do not move: the same seeds give the same tokens and logprobs, bit
    for bit, from a cache of 11 positions as from one of the model's 128."""
    tok = load_tokenizer(str(tiny_dir))
    prompts = ["07+45=", "99+01=", "3+4=", "12+88="]
    outs = []
    for settings in (EngineConfig(max_seq_len=11, max_concurrent_seqs=32), EngineConfig(max_concurrent_seqs=32)):
        engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id, settings=settings)
        reqs = [
            GenerationRequest(i, tok(p)["input_ids"], 4, SamplingParams(5, 1.0, seed=10 + i))
            for i, p in enumerate(prompts)
        ]
        outs.append([[(s.completion_ids, s.logprobs) for s in group] for group in engine.generate(reqs)])
        assert engine.runner.max_seq_len == settings.max_seq_len or engine.runner.max_seq_len == 128
    assert outs[0] == outs[1]


def test_the_kv_budget_bounds_the_slots_but_never_below_a_group(tiny_dir):
    per_token = 2 * 1 * 1 * 16 * 4
    assert engine_slots(11, per_token, 1e12, 4) == 256
    assert engine_slots(11, per_token, 100 * 11 * per_token, 4) == 100
    assert engine_slots(11, per_token, 1.0, 4) == 4
    tight = short_run(tiny_dir, "engine.kv_cache_fraction=0.000001", "runtime.num_engines=2")
    # 1e-6 x 64 GiB / 2 engines = 34.4 KB: 24 sequences of 11 tokens x 128 bytes
    assert tight.cfg.engine.max_concurrent_seqs == int(1e-6 * 64 * GIB / 2 // (11 * per_token)) == 24
    assert any("engine.max_concurrent_seqs: 24" in n for n in tight.plan.notes)
    stated = short_run(tiny_dir, "engine.max_concurrent_seqs=7", "engine.max_seq_len=40")
    assert (stated.cfg.engine.max_concurrent_seqs, stated.cfg.engine.max_seq_len) == (7, 40)


def test_an_engine_outside_a_run_keeps_the_model_bound(tiny_dir):
    """`nonstop serve` has no run to ask: the model's positions (at most 4096), 256 slots in budget."""
    assert engine_limits(EngineConfig(), 128, 128, memory_bytes=64 * GIB) == (128, 256)
    assert engine_limits(EngineConfig(), 32768, 24576, memory_bytes=23 * GIB) == (4096, 49)  # 0.5B: 49 x 100 MB
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    assert (engine.runner.max_seq_len, engine.runner.num_slots) == (128, 256)


def test_vllm_max_model_len_defaults_to_the_same_bound(tiny_dir):
    fitted = short_run(tiny_dir, "engine.kind=vllm")
    assert fitted.cfg.engine.vllm.max_model_len == 11
    assert any(n.startswith("engine.vllm.max_model_len: 11 (longest prompt 6") for n in fitted.plan.notes)
    assert short_run(tiny_dir, "engine.kind=vllm", "engine.vllm.max_model_len=64").cfg.engine.vllm.max_model_len == 64


def test_env_runs_bound_sequences_by_max_episode_tokens():
    cfg = load_config(None, ["env.name=guess_number", "env.max_episode_tokens=48"])
    fitted = fit_run(cfg, run_rows(cfg), machine=MACHINE)
    assert fitted.cfg.engine.max_seq_len == 48


def test_the_default_job_keeps_its_learning_rate_and_resolves_its_engine():
    cfg = load_config()
    assert cfg.trainer.lr is None and TrainerConfig().learning_rate == 6e-4
    fitted = fit_run(cfg, run_rows(cfg), machine=MACHINE)
    assert fitted.cfg.trainer.lr == 6e-4  # exactly the tiny model's tuned value
    e = fitted.cfg.engine
    assert (e.max_seq_len, e.max_concurrent_seqs) == (6 + 4, 256)
    # one forward per step: the whole batch's tokens, each prompt once and every completion
    r = cfg.rollout
    assert fitted.cfg.trainer.micro_batch_tokens == r.prompts_per_step * 6 + r.prompts_per_step * r.group_size * 4
    # everything else resolves as before: only the need-dependent fields differ
    before, after = cfg.model_dump(), fitted.cfg.model_dump()
    resolved = ("engine", "max_seq_len"), ("engine", "max_concurrent_seqs"), ("trainer", "lr")
    for section, key in (*resolved, ("trainer", "micro_batch_tokens")):
        before[section].pop(key), after[section].pop(key)
    before["engine"]["vllm"].pop("max_model_len"), after["engine"]["vllm"].pop("max_model_len")
    assert before == after


@pytest.mark.parametrize(
    "params,lora,expected",
    [(494_032_768, False, 4.5e-6), (7_000_000_000, False, 1.2e-6), (70_000_000_000, False, 1e-6),
     (20_000_000, False, 1e-5), (494_032_768, True, 4.5e-5)],
)  # fmt: skip
def test_learning_rate_rule_for_loaded_models(params, lora, expected):
    cfg = load_config(None, ["model.path=/m", "warmup.enabled=false", f"model.lora.enabled={str(lora).lower()}"])
    lr, why = learning_rate(cfg, params)
    assert lr == expected and "docs/memory.md" in why
    assert learning_rate(load_config(cfg, ["trainer.lr=3e-5"]), params) == (3e-5, "trainer.lr")


@pytest.mark.parametrize("params", [13_472, 500_000, 9_999_999])
def test_a_loaded_model_of_the_tiny_family_keeps_the_tiny_learning_rate(params):
    """A `nonstop warmup` base or an example's student loaded by model.path trains as the tiny model
    does (examples/tasks/cipher.yaml's distillation needs 6e-4: at 1e-5 it does not move in 45 steps)."""
    cfg = load_config(None, ["model.path=/m", "warmup.enabled=false"])
    lr, why = learning_rate(cfg, params)
    assert lr == 6e-4 and "under 10 M" in why


def test_a_task_shipped_base_takes_its_measured_learning_rate():
    """The long-rollout base collapses at the tiny model's 6e-4 (sizing/defaults.py TASK_BASE_LR)."""
    cfg = load_config(None, ["task.name=long_rollout"])
    assert learning_rate(cfg, None) == (1e-4, "the shipped long_rollout base's")
    assert learning_rate(load_config(cfg, ["trainer.lr=3e-4"]), None)[0] == 3e-4
    assert learning_rate(load_config(None, []), None) == (6e-4, "the built-in tiny model's")


def test_a_loaded_model_run_resolves_and_reports_its_learning_rate(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shape = dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14)
    shape |= dict(num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)
    (folder / "config.json").write_text(json.dumps({**shape, "max_position_embeddings": 32768}))
    make_char_tokenizer().save_pretrained(folder)
    cfg = load_config(None, [f"model.path={folder}", "warmup.enabled=false", "run.memory_limit_gib=64"])
    fitted = fit_run(cfg, run_rows(cfg), machine=MACHINE)
    assert fitted.cfg.trainer.lr == 4.5e-6
    assert "trainer.lr: 4.5e-06 (the rule for a loaded model of 494 M parameters" in "\n".join(fitted.plan.notes)


def test_nonstop_config_plan_prints_the_resolved_values_and_the_plan():
    from click.testing import CliRunner

    from nonstop.cli import main

    result = CliRunner().invoke(main, ["config", "--plan"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "  lr: 0.0006\n" in out and "  max_concurrent_seqs: 256\n" in out and "  max_seq_len: 10\n" in out
    assert "# memory plan: " in out and "#   engine         x1" in out
    refused = CliRunner().invoke(main, ["config", "--plan", *sets({"run.memory_limit_gib": 0.1})])
    assert refused.exit_code == 2 and "the run's memory plan needs" in refused.output


def test_unset_precision_is_auto_for_a_large_loaded_model_only(tiny_dir):
    """engine.dtype / trainer.precision left unset: auto from 50 M parameters of a loaded model up,
    None (float32 on the CPU) below it and for the built-in tiny model (docs/precision.md)."""
    from nonstop.sizing.defaults import AUTO_BF16_MIN_PARAMS, size_run
    from nonstop.sizing.shape import ModelShape

    def shape(hidden: int, layers: int) -> ModelShape:
        return ModelShape("qwen2", hidden, layers, 8, 2, hidden // 8, 4 * hidden, 128, True, 256)

    large, small = shape(1024, 8), shape(64, 1)
    assert large.params >= AUTO_BF16_MIN_PARAMS > small.params
    loaded = load_config(None, [f"model.path={tiny_dir}"])
    sized = size_run(loaded, large, 8, 64 * GIB)
    assert (sized.cfg.engine.dtype, sized.cfg.trainer.precision) == ("auto", "auto")
    assert any(n.startswith("trainer.precision: auto") for n in sized.notes)
    sized = size_run(loaded, small, 8, 64 * GIB)
    assert (sized.cfg.engine.dtype, sized.cfg.trainer.precision) == (None, None)
    sized = size_run(load_config(None, []), large, 8, 64 * GIB)  # the built-in tiny model: never resolved here
    assert (sized.cfg.engine.dtype, sized.cfg.trainer.precision) == (None, None)
    pinned = load_config(None, [f"model.path={tiny_dir}", "engine.dtype=float32", "trainer.precision=float32"])
    sized = size_run(pinned, large, 8, 64 * GIB)
    assert (sized.cfg.engine.dtype, sized.cfg.trainer.precision) == ("float32", "float32")


def test_unset_packed_and_compile_go_on_for_a_large_loaded_model_with_one_rank(tiny_dir):
    """trainer.packed / trainer.compile left unset: on for a loaded model from 50 M parameters up with
    one trainer rank (compile also needs no LoRA and a C++ compiler), each with a note saying why;
    off below that size, for the built-in tiny model, and where the user set them."""
    from nonstop.device import compile_blocker
    from nonstop.sizing.defaults import size_run
    from nonstop.sizing.shape import ModelShape

    def shape(hidden: int, layers: int) -> ModelShape:
        return ModelShape("llama", hidden, layers, 8, 2, hidden // 8, 4 * hidden, 128, True, 256)

    large, small = shape(1024, 8), shape(64, 1)
    loaded = load_config(None, [f"model.path={tiny_dir}"])
    sized = size_run(loaded, large, 8, 64 * GIB)
    assert sized.cfg.trainer.packed is True and sized.cfg.trainer.compile is (compile_blocker() is None)
    assert any(n.startswith("trainer.packed: true") for n in sized.notes)
    assert any(n.startswith("trainer.compile: ") for n in sized.notes)
    for small_or_tiny, model in ((small, [f"model.path={tiny_dir}"]), (large, [])):
        sized = size_run(load_config(None, model), small_or_tiny, 8, 64 * GIB)
        assert (sized.cfg.trainer.packed, sized.cfg.trainer.compile) == (None, None)
    two = size_run(load_config(None, [f"model.path={tiny_dir}", "trainer.ranks=2"]), large, 8, 64 * GIB)
    assert (two.cfg.trainer.packed, two.cfg.trainer.compile) == (False, False)
    assert any("trainer.compile: false (trainer.ranks 2" in n for n in two.notes)
    lora = size_run(load_config(None, [f"model.path={tiny_dir}", "model.lora.enabled=true"]), large, 8, 64 * GIB)
    assert lora.cfg.trainer.compile is False and lora.cfg.trainer.packed is True
    pinned = load_config(None, [f"model.path={tiny_dir}", "trainer.packed=false", "trainer.compile=false"])
    assert (
        size_run(pinned, large, 8, 64 * GIB).cfg.trainer.packed,
        size_run(pinned, large, 8, 64 * GIB).cfg.trainer.compile,
    ) == (False, False)


def test_vllm_kv_cache_is_sized_from_the_run_unless_the_user_chose_a_reserve(tiny_dir):
    """engine.kind vllm with neither kv_cache_gib nor memory_fraction set: the KV cache is what
    max_num_seqs sequences of max_model_len tokens need in whole 128-token blocks (a large model's
    weights no longer eat the fixed 10% of the machine meant for weights and cache); a reserve the
    user set is kept."""
    from nonstop.sizing.defaults import VLLM_MIN_KV_GIB, size_run
    from nonstop.sizing.shape import ModelShape

    qwen05 = ModelShape("qwen2", 896, 24, 14, 2, 64, 4864, 151_936, True, 32_768)
    fp32 = "engine.vllm.dtype=float32"  # the same figures whether or not this CPU has bf16
    cfg = load_config(None, [f"model.path={tiny_dir}", "engine.kind=vllm", "rollout.max_new_tokens=200", fp32])
    sized = size_run(cfg, qwen05, 56, 23 * GIB)
    v = sized.cfg.engine.vllm
    assert v.max_model_len == 256
    per_token = 2 * 24 * 2 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32
    assert v.kv_cache_gib == round(256 * 256 * per_token / GIB, 4) == 1.5
    assert any(n.startswith("engine.vllm.kv_cache_gib: 1.5 (") for n in sized.notes)
    short = size_run(load_config(None, [f"model.path={tiny_dir}", "engine.kind=vllm", fp32]), qwen05, 6, 23 * GIB)
    assert short.cfg.engine.vllm.kv_cache_gib == round(256 * 128 * per_token / GIB, 4)  # one block per sequence
    tiny = ModelShape("qwen2", 64, 1, 4, 1, 16, 256, 128, True, 128)
    assert size_run(cfg, tiny, 6, 23 * GIB).cfg.engine.vllm.kv_cache_gib == VLLM_MIN_KV_GIB
    for chosen in ("engine.vllm.memory_fraction=0.3", "engine.vllm.kv_cache_gib=2"):
        kept = size_run(load_config(None, [f"model.path={tiny_dir}", "engine.kind=vllm", chosen]), qwen05, 56, 23 * GIB)
        assert kept.cfg.engine.vllm.kv_cache_gib == (2 if chosen.endswith("=2") else None)
    builtin = size_run(load_config(None, [f"model.path={tiny_dir}"]), qwen05, 56, 23 * GIB)
    assert builtin.cfg.engine.vllm.kv_cache_gib is None


def test_vllm_dtype_left_unset_is_bf16_for_a_loaded_model_where_the_machine_has_it(tiny_dir):
    """engine.vllm.dtype None: bfloat16 for a loaded model of >= 50 M parameters where this machine
    computes bf16 natively, else float32; a small model, or a dtype the user set, stays as it is."""
    import torch

    from nonstop.device import bf16_supported
    from nonstop.sizing.defaults import size_run
    from nonstop.sizing.shape import ModelShape

    qwen05 = ModelShape("qwen2", 896, 24, 14, 2, 64, 4864, 151_936, True, 32_768)
    tiny = ModelShape("qwen2", 64, 1, 4, 1, 16, 256, 128, True, 128)
    cfg = load_config(None, [f"model.path={tiny_dir}", "engine.kind=vllm"])
    assert cfg.engine.vllm.dtype is None
    want = "bfloat16" if bf16_supported(torch.device("cpu")) else "float32"
    sized = size_run(cfg, qwen05, 6, 23 * GIB)
    assert sized.cfg.engine.vllm.dtype == want
    assert any(n.startswith(f"engine.vllm.dtype: {want} (a loaded model of 494 M") for n in sized.notes)
    chosen = {
        d: size_run(
            load_config(None, [f"model.path={tiny_dir}", "engine.kind=vllm", f"engine.vllm.dtype={d}"]),
            qwen05,
            6,
            23 * GIB,
        ).cfg.engine.vllm
        for d in ("bfloat16", "float32")
    }
    bf16_kv, fp32_kv = chosen["bfloat16"], chosen["float32"]
    assert (bf16_kv.dtype, fp32_kv.dtype) == ("bfloat16", "float32")
    assert bf16_kv.kv_cache_gib == fp32_kv.kv_cache_gib / 2  # the cache holds bf16 keys and values
    assert size_run(cfg, tiny, 6, 23 * GIB).cfg.engine.vllm.dtype is None  # float32 at start (engine/vllm/setup.py)


def test_a_base_the_warmup_builds_takes_the_warmup_learning_rate():
    """A user's task without a fitting shipped base is warmed up, and RL on that base runs at
    3e-4 (sizing/defaults.py WARMUP_BASE_LR); the default job's shipped base and an untrained
    start keep the tiny model's 6e-4, and trainer.lr set by hand wins."""
    task = ["task.name=jsonl", "task.dataset_path=examples/tasks/multiply.jsonl", "rollout.max_new_tokens=7"]
    cfg = load_config(None, task)
    fitted = fit_run(cfg, run_rows(cfg), machine=MACHINE)
    assert fitted.cfg.trainer.lr == 3e-4
    assert "trainer.lr: 0.0003 (a base the warm-up builds on the task" in "\n".join(fitted.plan.notes)
    for other in (load_config(None, [*task, "model.base=init"]), load_config(None, [])):
        assert fit_run(other, run_rows(other), machine=MACHINE).cfg.trainer.lr == 6e-4
    chosen = load_config(None, [*task, "trainer.lr=1e-3"])
    assert fit_run(chosen, run_rows(chosen), machine=MACHINE).cfg.trainer.lr == 1e-3
