"""nonstop.from_trl: TRL's GRPOConfig mapped field by field (values checked by hand), the fields with
no equivalent warned about, values nonstop cannot express refused naming the field."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from transformers import TrainingArguments

pytest.importorskip("trl", reason="TRL is in the dev extra; a venv without it (.venv-vllm) skips the mapping tests")
from trl import GRPOConfig
from trl.experimental.async_grpo import AsyncGRPOConfig

import nonstop
from nonstop.config import ConfigError, load_config
from nonstop.config.trl import TrlMappingWarning, trl_mapping
from nonstop.config.trl_fields import MAPPED, NO_EQUIVALENT
from support import ROOT

CPU = {"use_cpu": True, "bf16": False}


def grpo(tmp_path, **fields) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", **{**CPU, **fields})


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrlMappingWarning)  # a TrlMappingWarning here fails the test
        return fn(*args, **kwargs)


def test_trl_defaults_map_to_what_trl_would_do(tmp_path):
    m = quiet(trl_mapping, grpo(tmp_path))
    assert m.settings == {
        "rollout.group_size": 8,
        "rollout.prompts_per_step": 1,  # 8 completions a step / 8 per group
        "rollout.max_new_tokens": 512,
        "run.max_epochs": 3,
        "rollout.temperature": 1.0,
        "rollout.top_p": 1.0,
        "rollout.top_k": 0,
        "rollout.min_p": 0.0,
        "rollout.filter_uniform_reward": False,
        "run.max_time_s": None,
        "trainer.lr": 1e-6,
        "trainer.weight_decay": 0.0,
        "trainer.max_grad_norm": 1.0,
        "run.seed": 42,
        "trainer.kl_coef": 0.0,
        "trainer.kl_estimator": "k3",
        "trainer.clip_eps": 0.2,
        "trainer.clip_eps_high": 0.2,  # TRL's epsilon_high None is epsilon; nonstop's dapo would take 0.28
        "trainer.loss": "dapo",
        "trainer.advantage": "group_std",
        "trainer.group_std": "unbiased",
        "trainer.overlong_filter": False,  # nonstop's dapo filters overlong completions unless told
        "trainer.updates_per_batch": 1,
        "trainer.lr_schedule": "constant",
        "trainer.precision": "float32",
        "trainer.device": "cpu",
        "engine.device": "cpu",
        "trainer.activation_checkpointing": True,
        "run.out_dir": str(tmp_path / "out"),
        "checkpoint.every_steps": 500,
    }
    assert m.unmapped == {} and m.reward_weights is None
    assert m.notes == ["lr_scheduler_type 'linear' (TRL's default) decays to 0; nonstop keeps lr constant"]


def test_a_tuned_config_maps_field_by_field(tmp_path):
    args = grpo(
        tmp_path,
        num_generations=4,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=3,
        max_completion_length=64,
        learning_rate=3e-6,
        beta=0.04,
        epsilon=0.2,
        epsilon_high=0.28,
        delta=1.5,
        loss_type="dr_grpo",
        scale_rewards="none",
        mask_truncated_completions=True,
        num_iterations=2,
        temperature=0.7,
        top_p=0.95,
        top_k=50,
        min_p=0.05,
        max_steps=200,
        seed=7,
        warmup_steps=0.1,
        lr_scheduler_type="cosine",
        save_steps=25,
        save_total_limit=2,
        eval_strategy="steps",
        eval_steps=10,
        num_generations_eval=4,
        reward_weights=[1.0, 0.5],
        gradient_checkpointing=False,
        run_name="gsm8k",
    )
    m = quiet(trl_mapping, args)
    s = m.settings
    assert (s["rollout.group_size"], s["rollout.prompts_per_step"]) == (4, 6)  # 8 x 3 completions / 4
    assert s["rollout.max_new_tokens"] == 64 and s["run.max_steps"] == 200 and "run.max_epochs" not in s
    clip = (s["trainer.lr"], s["trainer.kl_coef"], s["trainer.clip_eps"], s["trainer.clip_eps_high"])
    assert clip == (3e-6, 0.04, 0.2, 0.28)
    assert s["trainer.clip_ratio_c"] == 1.5 and s["trainer.loss"] == "dr_grpo"
    assert s["trainer.advantage"] == "group_mean" and s["trainer.overlong_filter"] is True
    assert s["trainer.updates_per_batch"] == 2
    sampling = (s["rollout.temperature"], s["rollout.top_p"], s["rollout.top_k"], s["rollout.min_p"])
    assert sampling == (0.7, 0.95, 50, 0.05)
    assert s["run.seed"] == 7 and s["trainer.lr_warmup_steps"] == 20 and s["trainer.lr_schedule"] == "cosine"
    assert (s["checkpoint.every_steps"], s["checkpoint.keep"], s["run.eval_every"]) == (25, 2, 10)
    assert (s["task.eval_samples"], s["task.eval_temperature"]) == (4, 0.7)
    assert s["trainer.activation_checkpointing"] is False and s["run.name"] == "gsm8k"
    assert m.reward_weights == [1.0, 0.5] and m.unmapped == {}
    cfg = quiet(nonstop.from_trl, args, model="/models/x")
    assert cfg.model.path == "/models/x" and cfg.rollout.prompts_per_step == 6 and cfg.trainer.loss == "dr_grpo"
    assert cfg.run.max_time_s is None and cfg.trainer.clip_high == 0.28


def test_gspo_bnpo_and_vllm_corrections(tmp_path):
    gspo = trl_mapping(
        grpo(tmp_path, importance_sampling_level="sequence", loss_type="grpo", epsilon=3e-4, epsilon_high=4e-4)
    )
    assert gspo.settings["trainer.loss"] == "gspo"
    assert (gspo.settings["trainer.clip_eps"], gspo.settings["trainer.clip_eps_high"]) == (3e-4, 4e-4)
    assert trl_mapping(grpo(tmp_path, loss_type="bnpo")).settings["trainer.loss"] == "dapo"
    vllm = trl_mapping(grpo(tmp_path, use_vllm=True, vllm_gpu_memory_utilization=0.2))
    assert vllm.settings["engine.kind"] == "vllm" and vllm.settings["engine.vllm.memory_fraction"] == 0.2
    assert (vllm.settings["trainer.correction"], vllm.settings["trainer.is_hi"]) == ("seq_mis", 3.0)
    tis = trl_mapping(grpo(tmp_path, use_vllm=True, vllm_importance_sampling_mode="token_truncate"))
    assert (tis.settings["trainer.correction"], tis.settings["trainer.is_cap"]) == ("tis", 3.0)
    assert "trainer.correction" not in trl_mapping(grpo(tmp_path)).settings  # no vLLM in TRL: no mismatch to correct
    load_config(None, vllm.overrides())  # every value passes nonstop's own validation


def test_values_nonstop_cannot_express_are_errors_naming_the_field(tmp_path):
    cases = {
        "loss_type": ("cispo", r"GRPOConfig.loss_type='cispo': nonstop has no such loss"),
        "importance_sampling_level": ("sequence", r"importance_sampling_level='sequence': with loss_type 'dapo'"),
        "multi_objective_aggregation": ("normalize_then_sum", r"multi_objective_aggregation='normalize_then_sum'"),
        "fp16": (True, r"GRPOConfig.fp16=True: nonstop trains in float32 or bfloat16"),
        "num_train_epochs": (1.5, r"num_train_epochs=1.5: nonstop counts whole epochs"),
        "max_completion_length": (None, r"max_completion_length=None: nonstop needs a completion budget"),
        "per_device_train_batch_size": (6, r"per_device_train_batch_size=6: .* 6 completions a step, not whole groups"),
    }
    for name, (value, message) in cases.items():
        args = grpo(tmp_path)
        setattr(args, name, value)  # set after TRL's own checks, which refuse some of these first
        with pytest.raises(ConfigError, match=message):
            nonstop.from_trl(args)
    bnpo = grpo(tmp_path, loss_type="bnpo", gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"loss_type='bnpo': bnpo normalises by the tokens of each accumulated"):
        nonstop.from_trl(bnpo)
    with pytest.raises(ConfigError, match=r"from_trl: expected a trl.GRPOConfig; dict has no num_generations"):
        nonstop.from_trl({"learning_rate": 1e-5})


def test_fields_without_an_equivalent_are_listed_in_one_warning(tmp_path):
    args = grpo(
        tmp_path,
        repetition_penalty=1.1,
        sync_ref_model=True,
        logging_steps=1,
        steps_per_generation=4,
        adam_beta2=0.99,
        push_to_hub=False,
        learning_rate=1e-5,
    )
    with pytest.warns(TrlMappingWarning) as caught:
        cfg = nonstop.from_trl(args)
    assert len(caught) == 1
    text = str(caught[0].message)
    for name in ("repetition_penalty", "sync_ref_model", "logging_steps", "steps_per_generation", "adam_beta2"):
        assert f"  {name}: " in text, name
    assert "learning_rate" not in text and "push_to_hub" not in text  # mapped; and still its default
    assert "repetition_penalty: 1.1: no repetition penalty" in text
    assert cfg.trainer.lr == 1e-5


def test_async_grpo_config_maps_max_staleness(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_staleness=3, weight_sync_steps=2, **CPU)
    with pytest.warns(TrlMappingWarning, match="weight_sync_steps: 2: the trainer publishes weights after every step"):
        cfg = nonstop.from_trl(args)
    assert cfg.buffer.max_lag == 3 and cfg.rollout.group_size == args.num_generations


def test_every_grpo_field_is_mapped_or_said_to_have_no_equivalent():
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = {f.name for cls in (GRPOConfig, AsyncGRPOConfig) for f in dataclasses.fields(cls)} - base
    assert not own - MAPPED.keys() - NO_EQUIVALENT.keys(), "GRPO fields in neither table"
    known = base | own | {"max_prompt_length"}  # older TRL's field, mapped when present
    assert not (MAPPED.keys() | NO_EQUIVALENT.keys()) - known, "table entries TRL does not have"
    assert not MAPPED.keys() & NO_EQUIVALENT.keys()


def test_the_docs_page_names_every_field_of_the_tables():
    page = (ROOT / "docs" / "from_trl.md").read_text()
    missing = [name for name in [*MAPPED, *NO_EQUIVALENT] if f"`{name}`" not in page]
    assert not missing, f"docs/from_trl.md does not name {missing}"
