"""`support.cli.sets()`, which the tests and benches use for every `--set`, gives the real CLI the
values it was handed."""

import pytest
import yaml
from click.testing import CliRunner

from nonstop.cli import main
from support.cli import sets


def test_sets_writes_one_set_per_override_in_order():
    assert sets({"run.max_steps": 4, "buffer.depth": 0}) == ["--set", "run.max_steps=4", "--set", "buffer.depth=0"]
    assert sets({"warmup.enabled": False, "model.lora.enabled": True, "run.max_time_s": None}) == [
        *("--set", "warmup.enabled=false"),
        *("--set", "model.lora.enabled=true"),
        *("--set", "run.max_time_s=null"),
    ]
    assert sets(["buffer.depth=2", "buffer.depth=0"]) == ["--set", "buffer.depth=2", "--set", "buffer.depth=0"]
    with pytest.raises(TypeError, match="not the string"):
        sets("buffer.depth=0")


def test_the_cli_reads_back_what_sets_was_given(tmp_path):
    overrides = {
        "warmup.enabled": False,
        "model.lora.enabled": True,
        "run.max_time_s": None,
        "run.max_steps": 7,
        "trainer.lr": 1e-4,
        "run.out_dir": tmp_path / "a folder, with commas",
        "run.name": "two words",
        "buffer.depth": 0,
    }
    result = CliRunner().invoke(main, ["config", *sets(overrides)])
    assert result.exit_code == 0, result.output
    cfg = yaml.safe_load(result.output)
    assert cfg["warmup"]["enabled"] is False and cfg["model"]["lora"]["enabled"] is True
    assert cfg["run"]["max_time_s"] is None and cfg["run"]["max_steps"] == 7 and cfg["trainer"]["lr"] == 1e-4
    assert cfg["run"]["out_dir"] == str(tmp_path / "a folder, with commas") and cfg["run"]["name"] == "two words"
    assert cfg["buffer"]["depth"] == 0
