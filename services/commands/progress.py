"""Progress bars that say what is happening, in the unit it is counted in.

Every phase is one bar named in words, with its total known when it starts; bytes show as
kB/MB, everything else as a count of its unit (tensors, slots). Where the output is not a
terminal (a log, a pipe), bars cannot redraw, so each phase prints one line as it starts
instead: a log names every phase, and a script can wait for one. `Bars.follower()` draws
the follower's phases.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from rich.filesize import decimal
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import Console

BYTES = "bytes"
R = TypeVar("R")

# The follower's phases: what each is called and what it counts.
FOLLOWER_PHASES = {
    "fetch": ("downloading", BYTES),
    "apply": ("applying", "tensors"),
    "copy": ("copying the served slot", "slots"),
    "mirror": ("bringing the other slot up to date", "slots"),
    "verify": ("re-hashing a slot", BYTES),
}


def amount(count: float, unit: str) -> str:
    """`12.3 MB` for bytes, `23 tensors` (`1 tensor`) for anything else."""
    if unit == BYTES:
        return decimal(int(count))
    return f"{int(count):,} {unit.removesuffix('s') if int(count) == 1 else unit}"


def make_console() -> Console:
    """The console of a command's output; wide where it is not a terminal, so that a log
    keeps whole lines instead of 80 columns of truncated bars."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=160)


def measured(
    console: Console, measure: Callable[[Callable[[str], None]], R], *, timestamped: bool = False
) -> R:
    """Run a benchmark under one transient spinner that shows the phase it reports;
    `timestamped` also prints a line per phase with the seconds since the start (a long
    run's log then says where its time went)."""
    started = time.perf_counter()
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def phase(what: str) -> None:
            if timestamped:
                console.print(f"[{time.perf_counter() - started:7.1f} s] {what}", highlight=False)
            bar.update(task, description=what)

        return measure(phase)


def write_report(report: object, path: Path | None, console: Console) -> None:
    """Write a benchmark's figures as JSON where `--json` asks, and say where."""
    if path is not None:
        path.write_text(json.dumps(report, indent=2))
        console.print(f"wrote {path}")


class AmountColumn(ProgressColumn):
    """`done/total` in the task's unit (its `unit` field): bytes as sizes, else counts."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = DownloadColumn()

    def render(self, task: Task) -> Text:
        unit = str(task.fields.get("unit", ""))
        if task.total is None:  # a phase whose total nobody can know ahead: the count so far
            return Text(amount(task.completed, unit), style="progress.download")
        if unit == BYTES:
            return self._bytes.render(task)
        return Text(f"{int(task.completed):,}/{amount(task.total, unit)}", style="progress.download")


class Bars:
    """One bar per phase on `console` (a context manager)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            AmountColumn(),
            TimeElapsedColumn(),
            console=console,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> Bars:
        self.progress.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:  # a failure says one line: the bars leave the screen
            self.progress.live.transient = True
        self.progress.stop()

    def stop(self) -> None:
        """Stop drawing (the terminal gets its cursor back); safe to call twice."""
        self.progress.stop()

    def phase(self, key: str, label: str, unit: str, total: int | None) -> None:
        """Open (or reopen, for a second round of the same phase) a named bar."""
        task = self._tasks.get(key)
        if task is None:
            self._tasks[key] = self.progress.add_task(label, total=total, unit=unit)
        else:
            self.progress.reset(task, total=total, description=label, unit=unit)
        if not self.console.is_terminal and total != 0:  # a phase with nothing to do is not news
            size = "" if total is None else f" {amount(total, unit)}"
            self.console.print(f"{label}{size}", highlight=False, soft_wrap=True)

    def advance(self, key: str, n: int) -> None:
        task = self._tasks.get(key)
        if task is not None:
            self.progress.advance(task, n)

    def follower(self, prefix: str = "") -> FollowerBars:
        """The follower's progress interface onto these bars (`prefix` names whose phases
        they are, e.g. a cache being built)."""
        return FollowerBars(self, prefix)


class FollowerBars:
    """The follower's `start(phase, total)` / `advance(phase, n)`, drawn as named bars."""

    def __init__(self, bars: Bars, prefix: str) -> None:
        self.bars = bars
        self.prefix = prefix

    def start(self, phase: str, total: int) -> None:
        label, unit = FOLLOWER_PHASES.get(phase, (phase, "steps"))
        self.bars.phase(self.prefix + phase, self.prefix + label, unit, total)

    def advance(self, phase: str, n: int) -> None:
        self.bars.advance(self.prefix + phase, n)
