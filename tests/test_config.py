import pydantic
import pytest

from nonstop.config import Config, ConfigError, dump_config, load_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config()
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_misspelt_key_names_field_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["buffer.depht=2"])
    assert "buffer.depht: unknown field (did you mean 'depth'?)" in str(e.value)


def test_misspelt_section_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("trainr:\n  lr: 0.1\n")
    with pytest.raises(ConfigError, match=r"trainr: unknown field \(did you mean 'trainer'\?\)"):
        load_config(path)


def test_wrong_type_names_field():
    with pytest.raises(ConfigError, match=r"trainer\.lr: .*valid number.*'abc'"):
        load_config(overrides=["trainer.lr=abc"])


def test_out_of_range_names_field():
    with pytest.raises(ConfigError, match=r"rollout\.group_size: .*greater than or equal to 2"):
        load_config(overrides=["rollout.group_size=1"])


def test_loss_options_are_validated_by_name():
    with pytest.raises(ConfigError, match=r"trainer\.clip_ratio_c: .*greater than 1"):
        load_config(overrides=["trainer.clip_ratio_c=1.0"])
    with pytest.raises(ConfigError, match=r"trainer\.kl_clamp: .*greater than 0"):
        load_config(overrides=["trainer.kl_clamp=0"])
    with pytest.raises(ConfigError, match=r"trainer\.group_std: .*'population' or 'unbiased'"):
        load_config(overrides=["trainer.group_std=sample"])
    cfg = load_config(overrides=["trainer.clip_ratio_c=3", "trainer.kl_clamp=10", "trainer.group_std=unbiased"])
    assert (cfg.trainer.clip_ratio_c, cfg.trainer.kl_clamp, cfg.trainer.group_std) == (3.0, 10.0, "unbiased")
    default = load_config().trainer
    assert (default.clip_ratio_c, default.kl_clamp, default.group_std) == (None, None, "population")


def test_impossible_combination_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"buffer\.max_lag \(1\) < buffer\.depth \(3\)"):
        load_config(overrides=["buffer.depth=3", "buffer.max_lag=1"])


def test_overrides_parse_yaml_scalars_and_null():
    cfg = load_config(overrides=["buffer.depth=null", "trainer.lr=1e-4", "transport.kind=broadcast"])
    assert cfg.buffer.depth is None and cfg.trainer.lr == 1e-4 and cfg.transport.kind == "broadcast"


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(overrides=["trainer.lr"])


def test_config_is_frozen():
    cfg = Config()
    with pytest.raises(pydantic.ValidationError, match=r"lr\n  Instance is frozen"):
        cfg.trainer.lr = 1.0  # type: ignore[misc]
    assert cfg.trainer.lr == Config().trainer.lr


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_yaml11_words_stay_strings_for_enums_and_work_for_booleans(tmp_path):
    cfg = load_config(overrides=["run.progress=off", "warmup.enabled=no"])
    assert cfg.run.progress == "off" and cfg.warmup.enabled is False
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  progress: off\n")
    assert load_config(path).run.progress == "off"


def test_example_configs_validate():
    from pathlib import Path

    examples = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        load_config(path, ["model.path=x"] if "own_model" in path.name else [])
