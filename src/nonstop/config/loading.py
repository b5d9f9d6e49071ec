"""Loading a run configuration: YAML and `--set` overrides into a validated `Config` (root.py), and back.

`load_config(path, overrides)` reads an optional YAML file (or starts from a `Config`), applies
`a.b=c` overrides (values parsed as YAML scalars, but YAML 1.1's on/off/yes/no stay strings) and
validates the whole tree. Every problem becomes one `ConfigError` whose message names the dotted
field, e.g. `buffer.depht: unknown field (did you mean 'depth'?)`. `dump_config` writes a config
as YAML that loads back to the same tree (a run folder's config.yaml); `config_reference` is the
Markdown reference of every field (`nonstop config --markdown`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from nonstop.config.root import Config, ConfigError
from nonstop.config.schema import explain, reference


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{key}' is a value, not a section")
        node = child
    node[keys[-1]] = value


def format_validation_error(err: ValidationError) -> str:
    return explain(err, Config)


_YAML11_WORDS = {"on", "off", "yes", "no", "y", "n"}


def _parse_value(raw: str) -> Any:
    """An override value as a YAML scalar, except YAML 1.1's on/off/yes/no, which stay strings
    (so `run.progress=off` means 'off'; boolean fields still accept them through pydantic)."""
    if not raw.strip():
        return None
    if raw.strip().lower() in _YAML11_WORDS:
        return raw.strip()
    return yaml.safe_load(raw)


def load_config(path: str | Path | Config | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read YAML (optional; or start from a Config), apply `a.b=c` overrides, validate. Raises ConfigError."""
    tree: dict[str, Any] = {}
    if isinstance(path, Config):
        tree = path.model_dump(mode="json")
    elif path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded or {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. trainer.lr=1e-4")
        try:
            value = _parse_value(raw)
        except yaml.YAMLError as e:
            raise ConfigError(
                f"--set {key.strip()}: {raw!r} is not a valid value ({getattr(e, 'problem', None) or e})"
            ) from None
        _set_dotted(tree, key.strip(), value)
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def config_reference() -> str:
    """Markdown reference of every config field: type, default and its docstring."""
    return reference(Config, "Configuration reference")
