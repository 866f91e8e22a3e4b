"""`deltaboard pull`, `deltaboard follow`, `deltaboard verify` and `deltaboard bench follow`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from deltaboard.clients.board_client import BoardClient
    from deltaboard.clients.follower import Follower

BOARD = typer.Option("http://127.0.0.1:8080", "--board", envvar="DELTABOARD_URL", help="Board URL.")
TOKEN = typer.Option(None, "--token", envvar="DELTABOARD_TOKEN", help="A read-scope token.")
RUN = typer.Option(..., "--run", help="The run to follow.")
TO = typer.Option(..., "--to", help="The checkpoint directory to keep (created if absent).")
NODE = typer.Option(None, "--node-id", help="This node's id in the board's fleet (default: host:pid).")
WORKERS = typer.Option(4, "--workers", min=1, max=32, help="Parallel blob downloads.")


class RichProgress:
    """The follower's progress phases as rich progress bars (one task per phase)."""

    def __init__(self, bar: Progress) -> None:
        self.bar = bar
        self.tasks: dict[str, TaskID] = {}

    def start(self, phase: str, total: int) -> None:
        label = {"fetch": "downloading", "apply": "applying tensors", "copy": "copying the served slot"}
        task = self.tasks.get(phase)
        if task is None:
            self.tasks[phase] = self.bar.add_task(label.get(phase, phase), total=total)
        else:
            self.bar.reset(task, total=total)

    def advance(self, phase: str, n: int) -> None:
        if phase in self.tasks:
            self.bar.advance(self.tasks[phase], n)


def _follower(
    client: BoardClient,
    run: str,
    to: Path,
    node_id: str | None,
    workers: int,
    bar: Progress,
    on_version: Callable[[int], None] | None = None,
) -> Follower:
    from deltaboard.clients.follower import Follower

    node = node_id or f"{os.uname().nodename}:{os.getpid()}"
    progress = RichProgress(bar)
    return Follower(
        client, run, to, node_id=node, engine="cli", progress=progress, workers=workers, on_version=on_version
    )


@contextmanager
def _failures(console: Console) -> Iterator[None]:
    """Turn the follower's and the board's errors into one red line and exit status 1: an
    operator needs what went wrong (integrity, auth, unknown run), not a traceback."""
    from deltaboard.board.contract.errors import BoardError
    from deltaboard.clients.follower import FollowerError

    try:
        yield
    except (FollowerError, BoardError) as exc:
        # A board error names its code in the message: say only which family it is.
        kind = "BoardError" if isinstance(exc, BoardError) else type(exc).__name__
        console.print(f"[red]{kind}: {exc}[/]")
        raise typer.Exit(1) from exc


def _bar(console: Console) -> Progress:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(), console=console
    )


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `pull`, `follow`, `verify` and `bench follow`."""

    @app.command("pull")
    def pull(
        run: str = RUN,
        to: Path = TO,
        version: int | None = typer.Option(
            None, "--version", min=0, help="The version to reach (default: head)."
        ),
        board: str = BOARD,
        token: str | None = TOKEN,
        node_id: str | None = NODE,
        workers: int = WORKERS,
    ) -> None:
        """Bring DIR to a version of the run once (bootstrap or catch up), then exit."""
        import time

        from rich.console import Console

        from deltaboard.clients.board_client import BoardClient

        console = Console()
        started = time.perf_counter()
        with (
            _failures(console),
            BoardClient(board, token) as client,
            _bar(console) as bar,
            _follower(client, run, to, node_id, workers, bar) as follower,
        ):
            before = follower.version
            held = follower.sync(version)
        console.print(f"[bold]{run}[/] {before} -> {held} in {to} ({time.perf_counter() - started:.2f} s)")

    @app.command("follow")
    def follow(
        run: str = RUN,
        to: Path = TO,
        board: str = BOARD,
        token: str | None = TOKEN,
        node_id: str | None = NODE,
        workers: int = WORKERS,
    ) -> None:
        """Keep DIR at the run's head (long-poll) until interrupted (Ctrl-C or SIGTERM)."""
        import signal
        import threading

        from rich.console import Console

        from deltaboard.clients.board_client import BoardClient

        console = Console()
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        with _failures(console), BoardClient(board, token) as client, _bar(console) as bar:
            announce = lambda v: console.print(f"[bold]{run}[/] serving version {v}")  # noqa: E731
            with _follower(client, run, to, node_id, workers, bar, announce) as follower:
                console.print(f"following {run} into {to} (holding {follower.version})")
                follower.follow(stop)
        console.print("stopped")

    @app.command("verify")
    def verify(
        directory: Path = typer.Argument(..., exists=True, file_okay=False, help="A follower directory."),
        board: str | None = typer.Option(
            None,
            "--board",
            envvar="DELTABOARD_URL",
            help="Check against the board's manifest (default: cached).",
        ),
        token: str | None = TOKEN,
    ) -> None:
        """Re-hash every served tensor of DIR against its version's manifest."""
        from rich.console import Console

        from deltaboard.clients.board_client import BoardClient
        from deltaboard.clients.follower.verify import served, verify_directory

        console = Console()
        with _failures(console):
            now = served(directory)
            manifest = None
            if board is not None:
                with BoardClient(board, token) as client:
                    manifest = client.manifest(now.run, now.version)
        with _bar(console) as bar:
            task = bar.add_task(f"hashing {now.run}@{now.version}", total=None)
            report = verify_directory(directory, manifest, lambda n: bar.advance(task, n))
        for name in report.bad_tensors:
            console.print(f"[red]tensor {name} does not hash to its recorded digest[/]")
        for problem in report.problems:
            console.print(f"[red]{problem}[/]")
        if not report.ok:
            raise typer.Exit(1)
        source = "the board's" if manifest is not None else "the cached"
        console.print(
            f"[green]ok[/]: {report.tensors} tensors, {report.bytes:,} bytes match {source} manifest"
        )

    @bench.command("follow")
    def bench_follow(
        quick: bool = typer.Option(False, "--quick", help="A smaller view: under a minute on 2 cores."),
        json_path: Path | None = typer.Option(None, "--json", help="Write the figures here."),
        view_gb: float | None = typer.Option(
            None, help="Size of the bf16 view in GB (default 1; quick 0.125)."
        ),
    ) -> None:
        """Per-version apply+verify vs a full write, bootstrap time, and a node 32 behind."""
        from dataclasses import replace

        from rich.console import Console
        from rich.progress import Progress

        from deltaboard.services.bench import follow_bench

        config = follow_bench.QUICK if quick else follow_bench.BenchConfig()
        config = replace(config, view_gb=view_gb or config.view_gb)
        console = Console()
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task("starting", total=None)
            report = follow_bench.run(config, lambda what: bar.update(task, description=what))
        follow_bench.render(report, console)
        if json_path is not None:
            json_path.write_text(json.dumps(report, indent=2))
            console.print(f"wrote {json_path}")
