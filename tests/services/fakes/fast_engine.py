"""The bench's fast fake engine (`services.bench.sidecar_bench.FastEngine`) in its own
process, for the tests of the sidecar under load."""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

from deltaboard.services.bench.sidecar_bench import engine_process


@contextlib.contextmanager
def fast_engine() -> Iterator[str]:
    """The engine's URL while it runs."""
    context = multiprocessing.get_context("spawn")
    port, theirs = context.Pipe()
    process = context.Process(target=engine_process, args=(theirs,), daemon=True)
    process.start()
    try:
        yield f"http://127.0.0.1:{port.recv()}"
    finally:
        process.terminate()
        process.join(10)
