"""What every command shares, so that the commands read the same everywhere.

- The board: `--board` (DELTABOARD_URL) and `--token` (DELTABOARD_TOKEN) in every command
  that talks to one.
- The checkpoint directory: `--dir` in every command that reads or keeps one (`publish`,
  `verify`, `pull`, `follow`, `engine`, `sidecar`); the names it had before (`--to`,
  `--model`, a positional DIR) still work, hidden from the help.
- Time: a command reports its duration from the start of its process, interpreter start-up
  and imports included, not from some step inside it, since that is what the person
  waiting saw.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer

from deltaboard.services.commands.failures import UserError

DEFAULT_BOARD = "http://127.0.0.1:8080"


def _process_start() -> float:
    """When this process started, on the `CLOCK_BOOTTIME` clock: field 22 of Linux's
    `/proc/self/stat`, in clock ticks since boot. Elsewhere: now, at the CLI's import."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # the name in () may hold spaces
        return int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.clock_gettime(time.CLOCK_BOOTTIME)


STARTED = _process_start()


def elapsed() -> float:
    """Seconds since the command's process started."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) - STARTED


def board_option() -> Any:
    return typer.Option(DEFAULT_BOARD, "--board", envvar="DELTABOARD_URL", help="The board's URL.")


def token_option(scope: str) -> Any:
    return typer.Option(
        None,
        "--token",
        envvar="DELTABOARD_TOKEN",
        help=f"A {scope}-scope token of the board (default: none).",
        show_default=False,
    )


def dir_option(what: str) -> Any:
    return typer.Option(None, "--dir", help=f"{what} [required]", show_default=False)


def hidden_alias(name: str) -> Any:
    """The option's old name, still accepted and no longer shown."""
    return typer.Option(None, name, hidden=True)


def hidden_argument() -> Any:
    """The positional DIR that `--dir` replaced, still accepted and no longer shown."""
    return typer.Argument(None, hidden=True, show_default=False)


def checkpoint_dir(given: Path | None, alias: Path | None, *, must_exist: bool) -> Path:
    """The directory named by `--dir` or by its old name; a file is refused, and so is a
    missing directory where the command reads one."""
    if given is not None and alias is not None and given != alias:
        raise UserError(f"two directories given ({given} and {alias}): pass one --dir")
    chosen = given if given is not None else alias
    if chosen is None:
        raise typer.BadParameter("a checkpoint directory is required", param_hint="'--dir'")
    if chosen.exists() and not chosen.is_dir():
        raise UserError(f"{chosen} is a file: --dir names a checkpoint directory")
    if must_exist and not chosen.exists():
        raise UserError(f"{chosen} does not exist")
    return chosen
