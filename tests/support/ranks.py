"""Rank processes for the torch.distributed tests, forked from a server that imported torch
once.

Each rank is a process of its own (gloo on CPU, as a trainer's ranks are), but starting
one by `spawn` imports torch, transformers and the publisher again: several seconds of
CPU per rank on a 2-core machine, for tests whose ranks run for less than that. Under
multiprocessing's `forkserver` a server process imports those modules once (its preload)
and forks each rank from itself; it is single-threaded, so the fork is safe, and it
serves every later test of the same test process.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

from torch.multiprocessing.spawn import start_processes

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers.models.llama.modeling_llama",
    "deltaboard.publisher.distributed",
    "deltaboard.publisher.publisher",
]


def run_ranks(main: Callable[..., None], args: tuple[Any, ...], world: int) -> None:
    """Run `main(rank, *args)` in `world` processes and wait for all; a rank that fails
    fails the caller. `main` must be importable by its module's name."""
    multiprocessing.set_forkserver_preload(PRELOAD)
    start_processes(  # type: ignore[no-untyped-call]
        main, args=args, nprocs=world, join=True, start_method="forkserver"
    )
