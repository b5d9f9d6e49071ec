"""`nonstop serve`: an engine (built-in or vLLM) behind an OpenAI-compatible HTTP API (serve/).

`serve_cmd` checks its arguments (an empty API key is refused: click reads an empty
NONSTOP_API_KEY as unset, which would serve with no key at all), then loads the config, resolves
the model folder as `nonstop train` does (no model: a freshly made tiny one in a temporary
folder), runs vLLM's preflight when engine.kind is vllm, and serves on `--host`/`--port` until
SIGINT/SIGTERM. A config or model error is one red line and exit status 2; a server that cannot
start, exit status 1. The engine and the server load torch, so they are imported when the command
runs (`start-up:`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from nonstop.checkpoint import CheckpointError
from nonstop.config import ConfigError, load_config
from nonstop.config.preflight import resolve_model_path
from nonstop.errors import ServeError
from nonstop.orchestrator.launch import sigterm_as_ctrl_c


@click.command("serve")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config field, e.g. --set engine.max_concurrent_seqs=32",
)
@click.option(
    "--model", "model_path", default=None, help="Model folder (default: model.path; none: a fresh tiny model)."
)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="Address to bind; keep 127.0.0.1 unless you mean to expose it.",
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port (0: any free port).")
@click.option(
    "--api-key",
    default=None,
    envvar="NONSTOP_API_KEY",
    show_envvar=True,
    help="Require 'Authorization: Bearer KEY' on /v1/* (prefer the environment variable: arguments show in ps).",
)
@click.option("--served-model-name", default=None, help="Model id clients must use (default: the folder name).")
@click.option(
    "--engine",
    "engine_kind",
    default=None,
    type=click.Choice(["builtin", "vllm"]),
    help="Engine to serve with (default: engine.kind); vllm needs the vllm package (docs/vllm.md).",
)
def serve_cmd(
    config: str | None,
    overrides: tuple[str, ...],
    model_path: str | None,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
    engine_kind: str | None,
) -> None:
    """Serve the engine over an OpenAI-compatible HTTP API (token ids, logprobs and versions included)."""
    console = Console()
    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)  # while loading; serving, serve() stops cleanly on it
    # click reads an empty NONSTOP_API_KEY as unset, which would serve with no key at all
    if api_key is None and "NONSTOP_API_KEY" in os.environ:
        api_key = os.environ["NONSTOP_API_KEY"]
    if api_key is not None and not api_key.strip():
        raise click.BadParameter(
            "empty key: give a non-empty key, or leave --api-key and NONSTOP_API_KEY unset to serve without one",
            param_hint="--api-key / NONSTOP_API_KEY",
        )
    if engine_kind is not None:
        overrides = (*overrides, f"engine.kind={engine_kind}")
    try:
        _serve(console, config, overrides, model_path, host, port, api_key, served_model_name)
    except KeyboardInterrupt:  # Ctrl-C before the server runs (loading, a hub lookup); serving, it stops cleanly
        console.print("[yellow]interrupted[/]")
        sys.exit(130)


def _serve(
    console: Console,
    config: str | None,
    overrides: tuple[str, ...],
    model_path: str | None,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: str | None,
) -> None:
    try:  # as `nonstop train`: a bad field, a missing folder or an unreachable hub is one line, in bounded time
        cfg = load_config(config, overrides)
        given, local = model_path or cfg.model.path, None
        if given is not None:
            local = str(resolve_model_path(given, field="--model" if model_path else "model.path"))
        if cfg.engine.kind == "vllm":
            # start-up: torch only when this command runs
            from nonstop.engine.vllm.setup import preflight as vllm_preflight

            vllm_preflight(local, cfg.engine.vllm)  # before anything loads
    except ConfigError as e:
        console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        sys.exit(2)
    # start-up: torch only when this command runs
    from nonstop.serve.command import serve

    if given is None or local is None:
        # start-up: torch only when this command runs
        from nonstop.models.tiny import save_tiny

        path = str(save_tiny(Path(tempfile.mkdtemp(prefix="nonstop-serve-")) / "tiny", cfg.model.tiny, cfg.run.seed))
        console.print(f"no model given: serving a freshly initialised tiny model from {path}")
        name = served_model_name or Path(path).name
    else:
        path, name = local, served_model_name or Path(given).name

    def ready(bound: int) -> None:
        console.print(
            f"serving '{name}' on http://{host}:{bound} (/v1/completions, /v1/chat/completions, /health, "
            "/openapi.json)",
            highlight=False,
        )

    try:
        asyncio.run(serve(cfg, path, host, port, api_key, name, ready))
    except ServeError as e:
        console.print(f"[red]serve failed:[/] {e}", highlight=False)
        sys.exit(1)
    except (ConfigError, CheckpointError) as e:  # vLLM's refusals; an unreadable nonstop_version.json
        console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        sys.exit(2)
