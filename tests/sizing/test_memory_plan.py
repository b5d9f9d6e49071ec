"""The preflight memory plan (sizing/shape.py, sizing/memory.py, orchestrator/fit.py): counts from
config.json equal the instantiated models', the plan's figures equal hand-computed ones, and a
run that cannot fit is refused before any actor starts, naming the field to change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3Config

from nonstop.config import ConfigError, TinyModelConfig, TinyMoeConfig, load_config
from nonstop.models.tiny import make_char_tokenizer, tiny_config
from nonstop.orchestrator.fit import check_vllm_kv, fit_run
from nonstop.orchestrator.launch import run_rows
from nonstop.sizing.machine import GIB, MachineMemory
from nonstop.sizing.memory import plan_memory
from nonstop.sizing.shape import ModelShape
from support import EXAMPLES_DIR, child_env
from support.cli import sets

QWEN25_05B = dict(  # Qwen2.5-0.5B's shape (issue 31), vocabulary included
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
BIG_MACHINE = MachineMemory(total=64 * GIB, available=48 * GIB, source="a stated test machine")


@pytest.fixture(scope="module")
def half_b_dir(tmp_path_factory) -> Path:
    """A folder with the 0.5B shape's config.json and a tokenizer, and no weights at all."""
    folder = tmp_path_factory.mktemp("qwen05b-shape")
    (folder / "config.json").write_text(json.dumps(QWEN25_05B))
    make_char_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "config",
    [
        tiny_config(TinyModelConfig()),
        tiny_config(TinyModelConfig(moe=TinyMoeConfig())),
        tiny_config(TinyModelConfig(moe=TinyMoeConfig(kind="qwen2_moe"))),
        Qwen3Config(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            tie_word_embeddings=False,
        ),
        LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4),
        MixtralConfig(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
        ),
    ],
    ids=["qwen2", "qwen3_moe", "qwen2_moe", "qwen3", "llama", "mixtral"],
)
def test_parameter_count_from_config_json_equals_the_instantiated_model(config):
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_config(config.to_dict()).params == sum(p.numel() for p in model.parameters())


def test_qwen25_05b_shape_counts_and_the_issue_kv_figure():
    shape = ModelShape.from_config(QWEN25_05B)
    assert shape.params == 494_032_768  # Qwen2.5-0.5B's published count
    # the old default reservation, 256 sequences x 4096 tokens: 25.8 GB (issue 31)
    assert 256 * 4096 * shape.kv_bytes_per_token(4) == 25_769_803_776


def small_run(tiny_dir: Path, *extra: str):
    cfg = load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "warmup.enabled=false",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "rollout.max_new_tokens=3",
            *extra,
        ],
    )
    return cfg, run_rows(cfg)


def test_plan_figures_equal_hand_computed_values(tiny_dir):
    """conftest's SMALL model: hidden 32, 1 layer, 2 heads of 16, 1 KV head, MLP 64, vocab 128, tied."""
    cfg, data = small_run(tiny_dir)
    params = 128 * 32 + (32 * 32 + 2 * 32 * 16 + 32 * 32) + (32 + 2 * 16) + 3 * 32 * 64 + 2 * 32 + 32
    assert params == 13_472
    fitted = fit_run(cfg, data, machine=BIG_MACHINE)
    assert fitted.shape.params == params
    e = fitted.cfg.engine
    assert (e.max_seq_len, e.max_concurrent_seqs, e.vllm.max_model_len) == (6 + 3, 256, 9)  # "07+45=": 6 chars
    items = {(p.name, i.name): i.bytes for p in fitted.plan.procs for i in p.items}
    kv_per_token = 2 * 1 * 1 * 16 * 4  # K and V x layers x KV heads x head dim x float32
    tokens = 4 * 6 + 8 * 3  # each prompt once + every completion (trainer/forward.py)
    expected = {
        ("engine", "weights"): params * 4,
        ("engine", "kv_cache"): 256 * 9 * kv_per_token,
        ("engine", "logits"): 256 * 128 * (4 + 4),  # one pass of 256 rows: float32 logits (no copy), log-probs
        # one layer's decode attention: 256 rows x 9 positions x 2 query heads x 16, keys and values expanded
        ("engine", "attention temporaries"): 256 * 9 * 2 * 16 * 12,
        ("engine", "prefix cache"): 256 * 9 // 8 * kv_per_token,  # an eighth of the KV cache by default
        ("engine", "runtime"): 300 * 1024**2,
        ("trainer", "weights"): params * 4,
        ("trainer", "grads"): params * 4,
        ("trainer", "optimizer"): 2 * params * 4,  # AdamW: two float32 states
        ("trainer", "step temporaries"): params * 4,  # and one parameter-sized temporary in its step
        ("trainer", "embedding gradient"): 128 * 32 * 4,  # tied: the input embedding's dense gradient
        # + one chunk's logits (recomputed in the backward), its gradient and the matmuls' operands (8 rows
        # of 3 tokens), float32
        ("trainer", "activations"): tokens * 1 * (6 * 32 + 2 * 16 + 4 * 64) * 4 + 3 * 8 * 3 * 128 * 4,
        ("trainer", "runtime"): 300 * 1024**2,
        ("orchestrator", "runtime"): 400 * 1024**2,
        ("shm segment", "slots"): (1 + 2) * params * 4,  # N + 2 slots of the float32 weights
    }
    # run.memory_headroom (0.3) of each process's estimated items: the runtime, activations,
    # logits and attention temporaries; weights, states and caches are counted exactly
    engine_estimates = 256 * 128 * 8 + 256 * 9 * 2 * 16 * 12 + 300 * 1024**2
    trainer_estimates = expected[("trainer", "activations")] + 300 * 1024**2
    expected[("engine", "headroom")] = int(0.3 * engine_estimates)
    expected[("trainer", "headroom")] = int(0.3 * trainer_estimates)
    expected[("orchestrator", "headroom")] = int(0.3 * 400 * 1024**2)
    assert items == expected
    assert fitted.plan.total == sum(items.values())
    assert fitted.plan.limit == 48 * GIB
    kv = 256 * 9 * 128
    engine_items = params * 4 + kv + kv // 8 + 256 * 128 * 8 + 256 * 9 * 32 * 12 + 300 * 2**20
    assert fitted.plan.planned("engine-0") == engine_items + int(0.3 * engine_estimates)
    record = fitted.plan.to_dict()
    assert record["fits"] and record["total_bytes"] == fitted.plan.total
    assert any(n.startswith("engine.max_seq_len: 9 (longest prompt 6") for n in record["resolved"])
    # the whole batch is one forward: its 48 tokens' activations fit a quarter of the 64 GiB machine
    assert fitted.cfg.trainer.micro_batch_tokens == tokens
    assert any(n.startswith("trainer.micro_batch_tokens: 48 (the whole batch's forward") for n in record["resolved"])


def test_micro_batches_and_activation_checkpointing_bound_the_plan_s_activations(tiny_dir):
    """trainer.micro_batch_tokens 12 of the batch's 48 forward tokens: the plan counts 12 tokens and
    the share of the rows they hold (8 x 12 / 48 = 2); with activation checkpointing each token keeps
    one hidden vector per layer (1 x 32) plus one layer's values (480)."""
    cfg, data = small_run(tiny_dir, "trainer.micro_batch_tokens=12")
    fitted = fit_run(cfg, data, machine=BIG_MACHINE)
    items = {(p.name, i.name): i for p in fitted.plan.procs for i in p.items}
    act = items[("trainer", "activations")]
    assert act.bytes == 12 * 480 * 4 + 3 * 2 * 3 * 128 * 4
    assert "12 tokens of one micro-batch" in act.detail and act.field == "trainer.micro_batch_tokens"
    assert "trainer.micro_batch_tokens: 12 (set; 4 micro-batches of the batch's 48 tokens at most)" in fitted.plan.notes
    cfg, data = small_run(tiny_dir, "trainer.micro_batch_tokens=12", "trainer.activation_checkpointing=true")
    items = {(p.name, i.name): i for p in fit_run(cfg, data, machine=BIG_MACHINE).plan.procs for i in p.items}
    assert items[("trainer", "activations")].bytes == 12 * (1 * 32 + 480) * 4 + 3 * 2 * 3 * 128 * 4


def test_lora_plans_adapter_gradients_and_slots(tiny_dir):
    cfg, data = small_run(tiny_dir, "model.lora.enabled=true", "model.lora.rank=4", "transport.kind=broadcast")
    fitted = fit_run(cfg, data, machine=BIG_MACHINE)
    adapters = 1 * 4 * ((32 + 32) + 2 * (32 + 16) + (32 + 32) + 2 * (32 + 64) + (64 + 32))  # r x (in + out)
    items = {(p.name, i.name): i.bytes for p in fitted.plan.procs for i in p.items}
    assert items[("trainer", "grads")] == adapters * 4 and items[("trainer", "optimizer")] == adapters * 8
    assert items[("engine", "transport")] == 2 * adapters * 4  # broadcast: ready + receiving adapter buffers
    assert not any(p.name == "shm segment" for p in fitted.plan.procs)
    base = 1 * (32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64)  # q, k, v, o, gate, up, down: in x out
    assert items[("engine", "adapter base")] == base * 4  # the float32 engine's copy it merges into
    assert ("trainer", "embedding gradient") not in items  # the embedding is frozen


def test_bf16_items_autocast_copies_and_a_lora_engine_merging_into_its_live_weights(tiny_dir):
    """A bf16 trainer keeps autocast's bf16 copies of every weight (and the head's bf16 gradient)
    for backward; a bf16 LoRA engine merges the float32 adapters into its live bf16 weights from
    a bf16 copy of the targeted base, with no staging copy of the model."""
    params, head, base = 13_472, 128 * 32, 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    cfg, data = small_run(tiny_dir, "trainer.precision=bfloat16", "engine.dtype=bfloat16", "model.lora.enabled=true")
    items = {(p.name, i.name): i.bytes for p in fit_run(cfg, data, machine=BIG_MACHINE).plan.procs for i in p.items}
    assert items[("trainer", "autocast copies")] == (params + head) * 2
    assert items[("engine", "adapter base")] == base * 2 and items[("engine", "weights")] == params * 2
    assert ("engine", "staging") not in items
    staged, data = small_run(tiny_dir, "engine.dtype=bfloat16", "model.lora.enabled=true", "engine.update_mode=drain")
    items = {(p.name, i.name): i.bytes for p in fit_run(staged, data, machine=BIG_MACHINE).plan.procs for i in p.items}
    assert items[("engine", "staging")] == params * 2  # a copy in the engine's own dtype, merged into, swapped in
    fp32, data = small_run(tiny_dir, "trainer.precision=float32")
    items = {(p.name, i.name): i.bytes for p in fit_run(fp32, data, machine=BIG_MACHINE).plan.procs for i in p.items}
    assert ("trainer", "autocast copies") not in items


def test_a_bf16_engine_receives_half_the_bytes_into_its_live_model(tiny_dir):
    """transport.dtype 'auto' with a bf16 built-in engine on the host: the slots hold bf16 weights and the
    engine needs no staging copy; asked for float32, it stages a float32 copy and the slots double;
    LoRA and vLLM keep float32, and a half-precision transport with either is refused naming the field."""
    from nonstop.sizing.defaults import wire_dtype

    params = 13_472  # test_plan_figures_equal_hand_computed_values
    plans = {}
    for wire in ("auto", "float32"):
        cfg, data = small_run(tiny_dir, "engine.dtype=bfloat16", f"transport.dtype={wire}")
        fitted = fit_run(cfg, data, machine=BIG_MACHINE)
        plans[wire] = {(p.name, i.name): i.bytes for p in fitted.plan.procs for i in p.items}
        assert wire_dtype(cfg) == ("bfloat16" if wire == "auto" else "float32")
    assert plans["auto"][("shm segment", "slots")] == 3 * params * 2
    assert ("engine", "staging") not in plans["auto"] and plans["auto"][("engine", "weights")] == params * 2
    # bf16 logits, their float32 copy and the log-probs: 256 rows x 128 ids x (2 + 4 + 4) bytes
    assert plans["auto"][("engine", "logits")] == 256 * 128 * 10
    assert plans["float32"][("shm segment", "slots")] == 3 * params * 4
    assert plans["float32"][("engine", "staging")] == params * 4
    lora, _ = small_run(tiny_dir, "engine.dtype=bfloat16", "model.lora.enabled=true")
    assert wire_dtype(lora) == "float32"
    with pytest.raises(ConfigError, match=r"transport.dtype: 'bfloat16'.*model.lora"):
        small_run(tiny_dir, "transport.dtype=bfloat16", "model.lora.enabled=true")


def test_a_plan_over_the_memory_limit_is_refused_naming_the_field(tiny_dir):
    cfg, data = small_run(tiny_dir, "engine.max_concurrent_seqs=65536", "engine.max_seq_len=128")
    # kv_cache 1.0 GiB + prefix cache 128 MiB + attention temporaries 3.0 GiB (65536 x 128 x 2 heads x 16
    # x 12 bytes) + logits 64 MiB (65536 rows x 128 x 8 bytes) + weights and runtimes
    with pytest.raises(ConfigError) as err:
        fit_run(cfg, data, machine=MachineMemory(total=2 * GIB, available=1 * GIB, source="a 1 GiB test machine"))
    assert str(err.value).startswith(
        "engine.max_concurrent_seqs: the run's memory plan needs 6.4 GiB but 1.0 GiB is available (the machine's "
        "available memory, a 1 GiB test machine); the largest part is the engine's attention temporaries, 3.0 GiB "
        "(65536 rows x 128 positions x 2 heads x 16 x 12 bytes: one layer's keys and values expanded to the query "
        "heads, and its scores); lower engine.max_concurrent_seqs or engine.max_seq_len. Plan: engine x1"
    )
    fit_run(load_config(cfg, ["run.memory_limit_gib=7"]), data, machine=BIG_MACHINE)  # a stated limit decides


def test_the_old_default_reservation_of_a_05b_model_is_refused_before_any_actor(half_b_dir, tmp_path):
    """`nonstop train` with the 0.5B shape and the old engine defaults (256 x 4096): refused with the
    field and the figures, exit status 2, no run folder. No weights exist: nothing could have loaded."""
    env = child_env(COLUMNS="400")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "nonstop.cli",
            "train",
            *sets(
                {
                    "model.path": half_b_dir,
                    "warmup.enabled": False,
                    "engine.max_concurrent_seqs": 256,
                    "engine.max_seq_len": 4096,
                    "engine.dtype": "float32",  # unset: auto (bf16 where the CPU has it); these are float32 figures
                }
            ),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, out
    assert out.startswith("engine.max_concurrent_seqs: the run's memory plan needs"), out
    assert "the engine's kv_cache, 24.0 GiB (256 seqs x 4096 tokens x 24 layers x 2 (K and V) x 2 KV heads" in out
    assert "lower engine.max_concurrent_seqs or engine.max_seq_len" in out
    assert not (tmp_path / "runs").exists()


def test_the_05b_shape_on_defaults_sizes_the_cache_from_need(half_b_dir):
    cfg = load_config(
        None,
        [
            f"model.path={half_b_dir}",
            "warmup.enabled=false",
            "run.memory_limit_gib=64",
            "engine.dtype=float32",
            "rollout.max_new_tokens=4",  # the addition task's answers (a loaded model's default is 256)
        ],
    )
    fitted = fit_run(cfg, run_rows(cfg))
    e = fitted.cfg.engine
    assert e.max_seq_len == 6 + 4 and e.max_concurrent_seqs == 256
    kv = next(i for p in fitted.plan.procs for i in p.items if (p.name, i.name) == ("engine", "kv_cache"))
    assert kv.bytes == 256 * 10 * 24 * 2 * 2 * 64 * 4  # 63 MB, not 25.8 GB
    assert fitted.plan.limit_source == "run.memory_limit_gib"
    headroom = sum(i.bytes for p in fitted.plan.procs for i in p.items if i.name == "headroom")
    # what is counted fits the 23 GiB machine kind this project runs on; run.memory_headroom's
    # stated margin on the estimates (0.3 x activations, logits, runtimes: 1.2 GiB) comes on top
    assert fitted.plan.total - headroom < 23 * GIB < fitted.plan.total


def test_a_small_memory_limit_is_refused_with_the_largest_part(half_b_dir):
    cfg = load_config(
        None,
        [
            f"model.path={half_b_dir}",
            "warmup.enabled=false",
            "run.memory_limit_gib=8",
            "engine.dtype=float32",
            "trainer.precision=float32",  # the same plan whether or not this CPU has bf16
            "rollout.max_new_tokens=4",  # the addition task's answers (a loaded model's default is 256)
        ],
    )
    with pytest.raises(ConfigError) as err:
        fit_run(cfg, run_rows(cfg))
    assert str(err.value).startswith(
        # the trainer's activations: micro-batches of 891 tokens (a quarter of 8 GiB), one chunk of logits
        "model.lora.enabled: the run's memory plan needs 22.0 GiB but 8.0 GiB is available (run.memory_limit_gib); "
        "the largest part is the shm segment's slots, 5.5 GiB ((1 engines + 2) slots x 1.8 GiB sent)"
    )
    lora = load_config(cfg, ["model.lora.enabled=true", "rollout.prompts_per_step=2", "rollout.group_size=2"])
    fitted = fit_run(lora, run_rows(lora))  # adapters only: their gradients, AdamW states and slots are small
    assert fitted.plan.total < 7.5 * GIB  # the float32 engine's weights and the base copy it merges into: 3.2 GiB


def test_a_resolved_micro_batch_shrinks_to_what_the_rest_of_the_plan_leaves(half_b_dir):
    """The 0.5B shape in bf16 with only model.path set, on a 22.3 GiB limit (this project's machine): a
    quarter of the memory for one micro-batch's activations (2,623 tokens) left the plan 4.5 GiB over
    and the run was refused; the resolved budget is lowered until the plan fits. A budget the user set
    is theirs: it is refused as before."""
    base = [
        f"model.path={half_b_dir}",
        "warmup.enabled=false",
        "run.memory_limit_gib=22.3",
        "engine.dtype=bfloat16",
        "trainer.precision=bfloat16",  # the same plan whether or not this CPU has bf16
        "rollout.prompts_per_step=2",
        "rollout.group_size=8",
    ]
    cfg = load_config(None, base)
    fitted = fit_run(cfg, run_rows(cfg))
    budget = fitted.cfg.trainer.micro_batch_tokens
    assert fitted.plan.total <= fitted.plan.limit
    shape = ModelShape.from_folder(half_b_dir)
    per_token = shape.activation_bytes_per_token() * 1.3  # activations and their share of the headroom
    quarter = int(0.25 * 22.3 * GIB // shape.activation_bytes_per_token())
    assert 262 <= budget < quarter  # at least one sequence (6 + 256 tokens), below the quarter rule
    # the largest budget that fits: one token more would put the plan over its limit
    assert fitted.plan.limit - fitted.plan.total < per_token + 1
    note = next(n for n in fitted.plan.notes if n.startswith("trainer.micro_batch_tokens:"))
    assert note.startswith(f"trainer.micro_batch_tokens: {budget} (the {quarter} whose activations fit 0.25")
    act = next(i for p in fitted.plan.procs for i in p.items if (p.name, i.name) == ("trainer", "activations"))
    assert f"{budget} tokens of one micro-batch" in act.detail
    with pytest.raises(ConfigError, match="^trainer.micro_batch_tokens: the run's memory plan needs"):
        fit_run(load_config(None, [*base, f"trainer.micro_batch_tokens={quarter}"]), run_rows(cfg))


SMOLLM2_135M = dict(  # SmolLM2-135M's shape (issue 50)
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def test_a_135m_model_at_the_default_batch_and_512_new_tokens_plans_within_20_gib(tmp_path):
    """Issue 50: SmolLM2-135M's shape, 32 prompts x 8 completions of up to 512 tokens, on a 23 GiB
    machine. The whole batch's forward is 32 x 6 + 256 x 512 = 131,264 tokens of about 1.14 MiB of
    activations each (143 GiB): micro_batch_tokens resolves to what fits a quarter of 23 GiB, and
    the trainer's head keeps one chunk of logits, not 256 x 512 x 49,152 of them."""
    folder = tmp_path / "smollm2-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))
    make_char_tokenizer().save_pretrained(folder)
    cfg = load_config(
        None,
        [
            f"model.path={folder}",
            "warmup.enabled=false",
            "rollout.max_new_tokens=512",
            "run.memory_limit_gib=23",
            "engine.dtype=float32",  # the same plan whether or not this CPU has bf16
            "trainer.precision=float32",
        ],
    )
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (32, 8)
    fitted = fit_run(cfg, run_rows(cfg))
    per_token = 30 * (6 * 576 + 2 * 192 + 4 * 1536) * 4
    assert fitted.shape.activation_bytes_per_token() == per_token == 1_198_080
    budget = fitted.cfg.trainer.micro_batch_tokens
    assert budget == int(0.25 * 23 * GIB // per_token) == 5153  # about 10 completions of 512 per micro-batch
    act = next(i for p in fitted.plan.procs for i in p.items if (p.name, i.name) == ("trainer", "activations"))
    assert act.bytes == 5153 * per_token + 3 * 1024 * 49152 * 4  # + one chunk of 1,024 positions' logits, 3 times
    assert fitted.plan.total < 21 * GIB, fitted.plan.table()  # headroom included: 20.1 GiB
    ckpt = fit_run(load_config(cfg, ["trainer.activation_checkpointing=true"]), run_rows(cfg))
    assert ckpt.cfg.trainer.micro_batch_tokens > 10 * budget  # one hidden vector per layer: 11x the tokens


def test_vllm_kv_reserve_smaller_than_one_sequence_is_refused(half_b_dir):
    shape = ModelShape.from_folder(half_b_dir)
    cfg = load_config(None, [f"model.path={half_b_dir}", "warmup.enabled=false", "engine.kind=vllm"])
    long = load_config(cfg, ["engine.vllm.max_model_len=32768"])
    with pytest.raises(
        ConfigError, match=r"^engine\.vllm\.max_model_len: one sequence of 32768 tokens needs 768\.0 MiB"
    ):
        check_vllm_kv(long, shape, int(23.5 * GIB))
    fitted = fit_run(load_config(cfg, ["run.memory_limit_gib=64"]), run_rows(cfg), machine=BIG_MACHINE)
    assert fitted.cfg.engine.vllm.max_model_len == 10  # the run's need, which vLLM's reserve holds


def test_plan_lists_gpu_items_apart_and_names_actors(tiny_dir):
    cfg, _ = small_run(tiny_dir, "engine.max_seq_len=16", "engine.max_concurrent_seqs=8", "runtime.num_engines=2")
    plan = plan_memory(cfg, ModelShape.from_folder(tiny_dir), BIG_MACHINE)
    assert plan.planned("engine-1") == plan.planned("engine") and plan.planned("trainer") is not None
    assert plan.planned("judge") is None
    seg = next(p for p in plan.procs if p.name == "shm segment")
    assert seg.host_bytes == (2 + 2) * 13_472 * 4
    lines = plan.table()
    assert lines[0].startswith("memory plan: ") and any(line.strip().startswith("engine") for line in lines[1:])


def test_the_own_model_memory_example_fits_the_05b_shape_on_this_machine_kind(half_b_dir, tmp_path):
    """examples/own_model_memory.yaml with a 0.5B-shaped model and a JSONL task of ~40-token prompts:
    every need-dependent default resolves, and LoRA keeps the plan under 10 GiB of a 23 GiB machine (9.5 GiB
    with a bf16 engine and trainer and the stated headroom, about 10 in float32 on a CPU without bf16)."""
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i + 1}? Answer: ", "answer": str(2 * i + 1)} for i in range(60)
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(
        EXAMPLES_DIR / "own_model_memory.yaml",
        [f"model.path={half_b_dir}", f"task.dataset_path={data}", "run.memory_limit_gib=23"],
    )
    fitted = fit_run(cfg, run_rows(cfg))
    longest = max(len(r["prompt"]) for r in rows)  # the character tokenizer: one token per character
    e = fitted.cfg.engine
    assert (e.max_seq_len, e.vllm.max_model_len, e.max_concurrent_seqs) == (longest + 32, longest + 32, 256)
    assert fitted.cfg.trainer.lr == 4.5e-5  # the loaded-model rule, x10 for LoRA
    assert fitted.plan.total < 10 * GIB, fitted.plan.table()


def test_a_vllm_engine_on_the_cpu_plans_its_packed_weights_and_a_lora_base(tiny_dir):
    """vLLM's CPU backend keeps a oneDNN-packed copy of the linear weights (a reload holds both);
    with LoRA the float32 host model it reloads from also keeps the targeted base to merge onto."""
    params, base = 13_472, 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    for dtype, nbytes in (("float32", 4), ("bfloat16", 2)):
        cfg, data = small_run(tiny_dir, "engine.kind=vllm", f"engine.vllm.dtype={dtype}", "model.lora.enabled=true")
        items = {(p.name, i.name): i.bytes for p in fit_run(cfg, data, machine=BIG_MACHINE).plan.procs for i in p.items}
        assert items[("engine", "packed copy")] == params * nbytes
        assert items[("engine", "staging")] == params * 4 and items[("engine", "adapter base")] == base * 4
