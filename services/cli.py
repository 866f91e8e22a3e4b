"""The `deltaboard` command line.

Each role registers its commands from its own module in `services.commands`; command
bodies import their heavy dependencies lazily so that `deltaboard board serve` never
imports torch.
"""

from __future__ import annotations

import importlib

import typer

COMMAND_MODULES = (
    "services.commands.board",
    "services.commands.codec",
    "services.commands.publish",
    "services.commands.rollout",
    "services.commands.serving",
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
