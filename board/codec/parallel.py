"""Split full-tensor passes over the machine's cores.

numpy releases the GIL inside its loops, so threads over disjoint ranges of a large
tensor run the passes that must touch every element (diff, digest) on every core.
Each range is further cut into cache-sized chunks by the callers so that intermediate
arrays stay in L2 instead of streaming through memory several times.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# Below this many elements a second thread costs more than it saves.
_PARALLEL_MIN = 1 << 18
_WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="codec")
        return _pool


def split(n: int, parallel_min: int = _PARALLEL_MIN) -> list[tuple[int, int]]:
    """Disjoint [start, stop) ranges covering [0, n): one per worker from `parallel_min`."""
    parts = _WORKERS if n >= parallel_min else 1
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


def map_ranges(fn: Callable[[int, int], T], n: int, parallel_min: int = _PARALLEL_MIN) -> list[T]:
    """`fn(start, stop)` over `split(n, parallel_min)`, in order, threaded when it pays."""
    ranges = split(n, parallel_min)
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    return list(_executor().map(lambda r: fn(*r), ranges))


def chunks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    """Cache-sized [a, b) pieces of [start, stop)."""
    return [(a, min(a + size, stop)) for a in range(start, stop, size)]
