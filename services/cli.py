"""The `deltaboard` command line.

Each role registers its commands from its own module in `deltaboard.services.commands`; command
bodies import their heavy dependencies lazily so that `deltaboard board serve` never
imports torch. `main` runs them all under one failure policy
(`deltaboard.services.commands.failures`): a user's mistake is one red line and exit 1,
`--debug` shows the traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer

from deltaboard.services.commands.failures import DEBUG_ENV, debugging, explain

COMMAND_MODULES = (
    "deltaboard.services.commands.board",
    "deltaboard.services.commands.codec",
    "deltaboard.services.commands.compact",
    "deltaboard.services.commands.hot",
    "deltaboard.services.commands.publish",
    "deltaboard.services.commands.quantize",
    "deltaboard.services.commands.rollout",
    "deltaboard.services.commands.serving",
)


def _show_version(show: bool) -> None:
    if show:
        from importlib.metadata import version

        typer.echo(f"deltaboard {version('deltaboard')}")
        raise typer.Exit()


def _options(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
    ),
    debug: bool = typer.Option(
        False, "--debug", envvar=DEBUG_ENV, help="Show the traceback of a failure, not one line."
    ),
) -> None:
    """deltaboard: lossless weight sync for RL post-training."""
    if debug:  # also for the processes a command starts (the demo's board and engines)
        os.environ[DEBUG_ENV] = "1"


def build_app() -> typer.Typer:
    # Plain help text: rich markup would eat bracketed words such as "[default]" in help.
    app = typer.Typer(
        no_args_is_help=True, rich_markup_mode=None, pretty_exceptions_enable=False, callback=_options
    )
    bench = typer.Typer(no_args_is_help=True, help="Benchmarks that print their figures (and --json PATH).")
    app.add_typer(bench, name="bench")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(app, bench)
    return app


def main() -> None:
    try:
        build_app()()
    except Exception as exc:
        line = None if debugging() else explain(exc)
        if line is None:
            raise
        from rich.console import Console
        from rich.markup import escape

        Console(stderr=True).print(f"[red]error:[/] {escape(line)}", soft_wrap=True, highlight=False)
        sys.exit(1)
