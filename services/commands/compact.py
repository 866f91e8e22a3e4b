"""`deltaboard compact`: the compaction worker (`deltaboard.services.compact`)."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from pathlib import Path

import typer

from deltaboard.services.commands.options import board_option, token_option


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `compact`."""

    @app.command("compact")
    def compact(
        run: str = typer.Option(..., "--run", help="The run to build spans for."),
        board: str = board_option(),
        token: str | None = token_option("compact"),
        directory: Path | None = typer.Option(
            None,
            "--dir",
            help="Where to keep the worker's copy of the run (default: a temporary directory, "
            "removed on exit; the worker is stateless).",
            show_default=False,
        ),
        keyframe_every: int = typer.Option(
            32,
            "--keyframe-every",
            min=0,
            help="Register a keyframe of a head when a new node's plan to it would start this many "
            "versions back or more (0: never).",
        ),
    ) -> None:
        """Build span patches (power-of-two spans ending at each head) from the run's
        committed deltas, and keyframes near head for new nodes, and register them with the
        board, fed by its event stream. Any number may run; kill it at any time."""
        from deltaboard.clients.board_client import BoardClient
        from deltaboard.services.compact.worker import run_worker

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        node = f"compact@{os.uname().nodename}:{os.getpid()}"
        with (
            BoardClient(board, token) as client,
            tempfile.TemporaryDirectory(prefix="deltaboard-compact-") as tmp,
        ):
            run_worker(client, run, directory or Path(tmp), node, threading.Event(), keyframe_every)
