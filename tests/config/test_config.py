import pytest
from pydantic import ValidationError

from nonstop.config import (
    BroadcastTransportConfig,
    Config,
    ConfigError,
    FilesTransportConfig,
    LocalRuntimeConfig,
    RayRuntimeConfig,
    ShmTransportConfig,
    config_reference,
    dump_config,
    load_config,
)
from support import ROOT


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
    with pytest.raises(ValidationError, match=r"lr\n  Instance is frozen"):
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
    examples = sorted(
        [
            *(ROOT / "examples").glob("*.yaml"),
            *(ROOT / "examples" / "api_agent").glob("*.yaml"),
            *(ROOT / "examples" / "smollm2").glob("*.yaml"),
        ]
    )
    assert examples
    for path in examples:
        load_config(path, ["model.path=x"] if "own_model" in path.name else [])


# Tagged sections: `transport.kind` and `runtime.backend` select a model with only its own fields.


def test_kind_selects_the_transport_model_and_defaults_to_shm(tmp_path):
    assert isinstance(load_config(overrides=["transport.checksum=true"]).transport, ShmTransportConfig)
    cfg = load_config(overrides=["transport.kind=broadcast", "transport.bucket_mb=4"])
    assert cfg.transport == BroadcastTransportConfig(bucket_mb=4)
    cfg = load_config(overrides=["transport.kind=files", "transport.dir=/w", "transport.notify=http"])
    assert isinstance(cfg.transport, FilesTransportConfig) and (cfg.transport.dir, cfg.transport.notify) == (
        "/w",
        "http",
    )
    assert "bucket_mb" not in dump_config(load_config())  # only the chosen kind's fields are written
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg
    ray = load_config(overrides=["runtime.backend=ray", "runtime.ray_engine.num_cpus=0.5"])
    assert isinstance(ray.runtime, RayRuntimeConfig) and ray.runtime.ray_engine.num_cpus == 0.5
    assert isinstance(load_config().runtime, LocalRuntimeConfig)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["transport.bucket_mb=4"], "transport.bucket_mb: only for transport.kind 'broadcast' (kind is 'shm')"),
        (
            ["transport.kind=files", "transport.per_tensor=true"],
            "transport.per_tensor: only for transport.kind 'broadcast' (kind is 'files')",
        ),
        (
            ["transport.kind=broadcast", "transport.dir=/w"],
            "transport.dir: only for transport.kind 'files' (kind is 'broadcast')",
        ),
        (["runtime.ray_address=auto"], "runtime.ray_address: only for runtime.backend 'ray' (backend is 'local')"),
        (
            ["runtime.ray_trainer.num_gpus=1"],
            "runtime.ray_trainer: only for runtime.backend 'ray' (backend is 'local')",
        ),
        (["transport.bukcet_mb=4"], "transport.bukcet_mb: unknown field (did you mean 'bucket_mb'?)"),
        (["transport.kind=nccl"], "transport.kind: expected one of 'shm', 'broadcast', 'files' (got 'nccl')"),
        (["runtime.backend=slurm"], "runtime.backend: expected one of 'local', 'ray' (got 'slurm')"),
        (["transport=shm"], "transport: expected a section (a mapping of fields) (got 'shm')"),
        (["transport.kind=broadcast", "transport.bucket_mb=0"], "transport.bucket_mb: Input should be greater than 0"),
        (
            ["runtime.backend=ray", "runtime.ray_engine.num_cpus=-1"],
            "runtime.ray_engine.num_cpus: Input should be greater",
        ),
        (
            ["runtime.backend=ray", "runtime.ray_engine.resources={GPU: 1}"],
            "runtime.ray_engine.resources: 'GPU' is a built-in resource: use num_cpus / num_gpus",
        ),
        (
            ["runtime.backend=ray", "runtime.ray_trainer.resources={head: 0}"],
            "runtime.ray_trainer.resources: amount of 'head' must be > 0",
        ),
        (
            ["runtime.backend=ray", "runtime.node_loss.policy=stay"],
            "runtime.node_loss.policy: Input should be 'replace' or 'wait'",
        ),
        (["runtime.max_engines=3"], "runtime.max_engines: only for runtime.backend 'ray' (backend is 'local')"),
    ],
)
def test_field_of_another_kind_or_bad_kind_is_one_clear_error(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    assert "\n" not in str(e.value), str(e.value)  # one problem, one line
    assert message in str(e.value)


# Every rule across fields: it fails with a message naming the fields, and the change the message
# suggests makes the config valid.
RULES = [
    (["buffer.depth=3", "buffer.max_lag=1"], r"buffer\.max_lag \(1\) < buffer\.depth \(3\)", ["buffer.reject=token"]),
    (
        ["trainer.ranks=2", "model.lora.enabled=true"],
        r"trainer\.ranks: data-parallel ranks with model\.lora",
        ["trainer.ranks=1"],
    ),
    (
        ["trainer.ranks=5", "rollout.prompts_per_step=4"],
        r"trainer\.ranks \(5\) > rollout\.prompts_per_step \(4\)",
        ["trainer.ranks=4"],
    ),
    (
        ["model.path=/m", "warmup.enabled=true"],
        r"warmup\.enabled: the warm-up trains the built-in tiny model",
        ["warmup.enabled=false"],
    ),
    (
        ["env.name=guess_number", "rollout.seed_per_prompt=true"],
        r"rollout\.seed_per_prompt: environment runs",
        ["rollout.seed_per_prompt=false"],
    ),
    (["task.name=jsonl"], r"task: .*task 'jsonl' needs dataset_path", ["task.dataset_path=d.jsonl"]),
    (
        ["model.tiny.num_heads=3"],
        r"model\.tiny: .*hidden_size must be divisible by num_heads",
        ["model.tiny.num_heads=8"],
    ),
    (
        ["model.tiny.num_kv_heads=3"],
        r"model\.tiny: .*num_heads must be divisible by num_kv_heads",
        ["model.tiny.num_kv_heads=4"],
    ),
    (
        ["trainer.is_lo=1.0", "trainer.is_hi=1.0"],
        r"trainer: .*is_lo \(1\.0\) must be below is_hi \(1\.0\)",
        ["trainer.is_hi=1.5"],
    ),
    (
        ["buffer.depth=0", "buffer.max_lag=0", "rollout.refill_ahead=true"],
        r"rollout\.refill_ahead: admitting replacements ahead needs rollout\.refill and a bounded buffer\.depth >= 1",
        ["rollout.refill_ahead=false"],
    ),
    (
        ["runtime.backend=ray", "runtime.num_engines=2", "runtime.max_engines=1"],
        r"runtime\.max_engines \(1\) < runtime\.num_engines \(2\)",
        ["runtime.max_engines=2"],
    ),
    (
        ["runtime.backend=ray", "runtime.max_engines=3"],
        r"runtime\.max_engines: engines that join on new nodes cannot reach a shared-memory segment",
        ["transport.kind=files"],
    ),
]


@pytest.mark.parametrize(
    "overrides,message,fix",
    RULES,
    ids=[
        "lag_below_depth",
        "ranks_with_lora",
        "ranks_above_prompts",
        "warmup_with_model_path",
        "seed_per_prompt_with_env",
        "jsonl_needs_dataset",
        "heads_divide_width",
        "kv_heads_divide_heads",
        "is_bounds",
        "refill_ahead_at_depth_0",
        "max_engines_below_num_engines",
        "growth_without_a_shared_transport",
    ],
)
def test_each_rule_across_fields_names_them_and_its_fix_works(overrides, message, fix):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
    load_config(overrides=overrides + fix)


def test_defaults_that_depend_on_other_fields_resolve_in_the_config():
    cfg = load_config()
    assert cfg.engine.max_lag is None and cfg.engine_settings.max_lag == cfg.buffer.max_lag == 2
    assert load_config(overrides=["engine.max_lag=5"]).engine_settings.max_lag == 5
    assert cfg.runtime.max_engine_restarts is None and cfg.engine_restarts == 3
    assert load_config(overrides=["transport.kind=files"]).engine_restarts == 3
    assert load_config(overrides=["transport.kind=broadcast"]).engine_restarts == 3  # the group takes a replacement
    assert load_config(overrides=["runtime.max_engine_restarts=7"]).engine_restarts == 7
    assert cfg.warmup.enabled is None and cfg.warmup_enabled is True
    assert load_config(overrides=["model.path=/m"]).warmup_enabled is False
    assert load_config(overrides=["warmup.enabled=false"]).warmup_enabled is False
    assert cfg.rollout.refill_ahead is None and cfg.refill_ahead is True  # depth 1, max_lag 2
    assert cfg.max_engines == 1 and load_config(overrides=["runtime.num_engines=3"]).max_engines == 3
    grow = ["runtime.backend=ray", "runtime.num_engines=2", "transport.kind=broadcast"]
    assert load_config(overrides=grow).max_engines == 2
    assert load_config(overrides=[*grow, "runtime.max_engines=5"]).max_engines == 5
    for off in (["buffer.depth=0"], ["buffer.max_lag=1"], ["buffer.depth=null"], ["rollout.refill=false"]):
        assert load_config(overrides=off).refill_ahead is False, off


def test_a_written_config_keeps_defaults_that_depend_on_other_fields(tmp_path):
    """A run's config.yaml leaves those defaults unset, so `--resume --set transport.kind=broadcast`
    or a changed buffer.max_lag still resolves them from the new values."""
    path = tmp_path / "c.yaml"
    path.write_text(dump_config(load_config()))
    cfg = load_config(path, ["transport.kind=broadcast", "buffer.max_lag=5", "model.path=/m"])
    assert (cfg.engine_restarts, cfg.engine_settings.max_lag, cfg.warmup_enabled) == (3, 5, False)


def test_reference_has_one_table_per_kind_and_docs_are_current():
    ref = config_reference()
    shm, broadcast, files = (ref.index(f"## transport (kind: {k})") for k in ("shm", "broadcast", "files"))
    common = ref.index("## transport\n")
    assert common < shm < broadcast < files
    assert "`transport.checksum`" in ref[common:shm] and "`transport.bucket_mb`" in ref[broadcast:files]
    assert "`transport.bucket_mb`" not in ref[:broadcast] + ref[files:]
    assert "| `transport.kind` | 'shm' or 'broadcast' or 'files' | `'shm'` |" in ref
    assert (
        "## runtime.ray_engine (backend: ray)" in ref and "`runtime.ray_address`" in ref[ref.index("(backend: ray)") :]
    )
    assert (ROOT / "docs" / "config.md").read_text() == ref + "\n", (
        "regenerate: nonstop config --markdown > docs/config.md"
    )


def test_forward_ahead_is_on_for_one_rank_at_depth_one_and_refused_with_several_ranks():
    assert load_config().forward_ahead  # the default job: depth 1, one trainer rank
    assert load_config(overrides=["buffer.depth=null"]).forward_ahead
    assert not load_config(
        overrides=["buffer.depth=0", "buffer.max_lag=0"]
    ).forward_ahead  # seeded runs repeat bit for bit
    assert not load_config(overrides=["trainer.ranks=2"]).forward_ahead
    assert load_config(overrides=["buffer.depth=0", "buffer.max_lag=0", "trainer.forward_ahead=true"]).forward_ahead
    with pytest.raises(ConfigError, match=r"trainer.forward_ahead needs one trainer rank \(got trainer.ranks=2\)"):
        load_config(overrides=["trainer.ranks=2", "trainer.forward_ahead=true"])
