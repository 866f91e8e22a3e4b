"""`deltaboard pull`, `deltaboard follow`, `deltaboard verify` and `deltaboard bench follow`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from deltaboard.services.commands.options import (
    DEFAULT_BOARD,
    board_option,
    checkpoint_dir,
    dir_option,
    elapsed,
    hidden_alias,
    hidden_argument,
    token_option,
)

if TYPE_CHECKING:
    from rich.console import Console

    from deltaboard.clients.board_client import BoardClient
    from deltaboard.clients.follower import Follower
    from deltaboard.clients.follower.journal import SlotName
    from deltaboard.services.commands.progress import Bars

RUN = typer.Option(..., "--run", help="The run to follow.")
DIR = "The checkpoint directory to keep (created if absent)."
NODE = typer.Option(
    None,
    "--node-id",
    help="This node's id in the board's fleet (default: host:pid).",
    show_default=False,
)
WORKERS_DEFAULT = 4
WORKERS = typer.Option(WORKERS_DEFAULT, "--workers", min=1, max=32, help="Parallel blob downloads.")
REPAIR = typer.Option(
    False,
    "--repair",
    help="First re-hash both copies the directory keeps and rebuild any damaged one "
    "(from the other copy, or from the board).",
)


def _follower(
    client: BoardClient,
    run: str,
    directory: Path,
    node_id: str | None,
    workers: int,
    bars: Bars,
    on_version: Callable[[int], None] | None = None,
) -> Follower:
    from deltaboard.clients.follower import Follower

    node = node_id or f"{os.uname().nodename}:{os.getpid()}"
    return Follower(
        client,
        run,
        directory,
        node_id=node,
        engine="cli",
        progress=bars.follower(),
        workers=workers,
        on_version=on_version,
    )


def stop_on_interrupt(bars: Bars) -> None:
    """Make Ctrl-C stop the command at once, as a kill would, and say how to go on.

    Nothing is waited for (downloads in flight, the tensor being written): the follower's
    directory is consistent at every instant, since it survives `kill -9` anywhere
    (`tests/clients/test_kill.py`), and the next run resumes from its journal and from
    the partial downloads in its cache. The handler only starts a thread that does the
    rest: it runs in the main thread, between two of its bytecodes, maybe in the middle
    of a write to the same stdout, which a second write from there would break.
    """
    import signal
    import threading

    from rich.console import Console

    def stop_now() -> None:
        bars.stop()
        Console(stderr=True).print("interrupted; run the same command again to resume", style="yellow")
        os._exit(130)

    def interrupted(signum: int, frame: object) -> None:
        threading.Thread(target=stop_now, name="interrupted", daemon=True).start()

    signal.signal(signal.SIGINT, interrupted)


def _served(version: int | None) -> str:
    return "nothing yet" if version is None else f"version {version}"


def _say_repaired(console: Console, damage: dict[SlotName, list[str]]) -> None:
    """One line per damaged slot that `Follower.repair` rebuilt."""
    for slot, tensors in sorted(damage.items()):
        named = ", ".join(tensors[:3]) + (f" and {len(tensors) - 3} more" if len(tensors) > 3 else "")
        console.print(f"[yellow]repaired slot {slot}: {named} did not hash to the recorded digest[/]")
    if not damage:
        console.print("nothing to repair: both slots hash to their recorded digests")


def register(app: typer.Typer, bench: typer.Typer) -> None:
    """Add `pull`, `follow`, `verify` and `bench follow`."""

    @app.command("pull")
    def pull(
        run: str = RUN,
        directory: Path | None = dir_option(DIR),
        to: Path | None = hidden_alias("--to"),
        version: int | None = typer.Option(
            None, "--version", min=0, help="The version to reach (default: head).", show_default=False
        ),
        board: str = board_option(),
        token: str | None = token_option("read"),
        node_id: str | None = NODE,
        workers: int = WORKERS,
        repair: bool = REPAIR,
    ) -> None:
        """Bring the directory to a version of the run once (bootstrap or catch up), then
        exit. Ctrl-C stops at once; the same command resumes."""
        from deltaboard.clients.board_client import BoardClient
        from deltaboard.services.commands.progress import Bars, make_console

        target = checkpoint_dir(directory, to, must_exist=False)
        console = make_console()
        with BoardClient(board, token) as client, Bars(console) as bars:
            stop_on_interrupt(bars)
            with _follower(client, run, target, node_id, workers, bars) as follower:
                before = follower.version
                if repair:
                    goal = version if version is not None else client.head(run).version
                    _say_repaired(console, follower.repair(goal))
                held = follower.sync(version)
        change = f"already at version {held}" if before == held else f"{_served(before)} -> version {held}"
        console.print(f"[bold]{run}[/]: {change} in {target} (done in {elapsed():.2f} s)")

    @app.command("follow")
    def follow(
        run: str = RUN,
        directory: Path | None = dir_option(DIR),
        to: Path | None = hidden_alias("--to"),
        board: str = board_option(),
        token: str | None = token_option("read"),
        node_id: str | None = NODE,
        workers: int = WORKERS,
    ) -> None:
        """Keep the directory at the run's head (long-poll) until stopped: SIGTERM stops
        after the update in progress, Ctrl-C at once (the same command resumes). A sidecar
        runs its own follower: do not run both on one directory."""
        import signal
        import threading

        from deltaboard.clients.board_client import BoardClient
        from deltaboard.services.commands.progress import Bars, make_console

        target = checkpoint_dir(directory, to, must_exist=False)
        console = make_console()
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with BoardClient(board, token) as client, Bars(console) as bars:
            stop_on_interrupt(bars)
            announce = lambda v: console.print(f"[bold]{run}[/] serving version {v}")  # noqa: E731
            with _follower(client, run, target, node_id, workers, bars, announce) as follower:
                console.print(f"following {run} into {target} (serving {_served(follower.version)})")
                follower.follow(stop)
        console.print("stopped")

    @app.command("verify")
    def verify(
        directory: Path | None = dir_option("The follower directory to check."),
        positional: Path | None = hidden_argument(),
        board: str | None = typer.Option(
            None,
            "--board",
            envvar="DELTABOARD_URL",
            help="Check against this board's manifest (default: the copy cached in the directory).",
            show_default=False,
        ),
        token: str | None = token_option("read"),
        repair: bool = REPAIR,
    ) -> None:
        """Re-hash every served tensor of the directory against its version's manifest."""
        from deltaboard.clients.board_client import BoardClient
        from deltaboard.clients.follower.patcher import read_placements
        from deltaboard.clients.follower.verify import served, verify_directory
        from deltaboard.services.commands.progress import BYTES, Bars, make_console

        target = checkpoint_dir(directory, positional, must_exist=True)
        console = make_console()
        now = served(target)
        if repair:
            with (
                BoardClient(board or DEFAULT_BOARD, token) as client,
                Bars(console) as bars,
                _follower(client, now.run, target, None, WORKERS_DEFAULT, bars) as follower,
            ):
                _say_repaired(console, follower.repair())
            now = served(target)
        manifest = None
        if board is not None:
            with BoardClient(board, token) as client:
                manifest = client.manifest(now.run, now.version)
        shards = sorted(now.slot_dir.glob("*.safetensors"))
        total = sum(p.nbytes for shard in shards for p in read_placements(shard).values())
        with Bars(console) as bars:
            bars.phase("hash", f"hashing {now.run}@{now.version}", BYTES, total)
            report = verify_directory(target, manifest, lambda n: bars.advance("hash", n))
        for name in report.bad_tensors:
            console.print(f"[red]tensor {name} does not hash to its recorded digest[/]")
        for problem in report.problems:
            console.print(f"[red]{problem}[/]")
        if not report.ok:
            console.print(f"[red]run `deltaboard verify --repair --dir {target}` to rebuild it[/]")
            raise typer.Exit(1)
        source = "the board's" if manifest is not None else "the cached"
        console.print(
            f"[green]ok[/]: {report.tensors} tensors, {report.bytes:,} bytes match {source} manifest"
        )

    @bench.command("follow")
    def bench_follow(
        quick: bool = typer.Option(False, "--quick", help="A smaller view: under a minute on 2 cores."),
        json_path: Path | None = typer.Option(
            None, "--json", help="Write the figures here (default: nowhere)."
        ),
        view_gb: float | None = typer.Option(
            None, help="Size of the bf16 view in GB (default: 1; quick 0.125)."
        ),
    ) -> None:
        """Per-version apply+verify vs a full write, bootstrap time, and a node 32 behind."""
        from dataclasses import replace

        from rich.console import Console

        from deltaboard.services.bench import follow_bench
        from deltaboard.services.commands.progress import measured, write_report

        config = follow_bench.QUICK if quick else follow_bench.BenchConfig()
        config = replace(config, view_gb=view_gb or config.view_gb)
        console = Console()
        report = measured(console, lambda status: follow_bench.run(config, status))
        follow_bench.render(report, console)
        write_report(report, json_path, console)
