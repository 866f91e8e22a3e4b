"""The `deltaboard` command line.

Each role registers its commands from its own module in `deltaboard.services.commands`; command
bodies import their heavy dependencies lazily so that `deltaboard board serve` never
imports torch.
"""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES = (
    "deltaboard.services.commands.board",
    "deltaboard.services.commands.codec",
    "deltaboard.services.commands.publish",
    "deltaboard.services.commands.rollout",
    "deltaboard.services.commands.serving",
)


def build_app() -> typer.Typer:
    app = typer.Typer(no_args_is_help=True, help="deltaboard: lossless weight sync for RL post-training.")
    bench = typer.Typer(no_args_is_help=True, help="Benchmarks that print their figures (and --json PATH).")
    app.add_typer(bench, name="bench")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(app, bench)
    return app


def main() -> None:
    build_app()()
