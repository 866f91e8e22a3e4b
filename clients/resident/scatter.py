"""The commit's compiled loop on host memory: check and scatter by address, all or nothing.

Every changed element of every tensor of one width is addressed absolutely (the tensor's
data pointer plus position times width), so one loop covers all tensors: the cost of a
commit follows the changed elements, not the number of tensors. numba reads and writes
those addresses through two small LLVM intrinsics (`inttoptr` + load/store); the
addresses are computed and bounds-checked by `ResidentView.stage` against tensors it
holds references to, never taken from input.

Large commits are split over the machine's cores (the loops release the GIL).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

# Below this many elements a second thread costs more than it saves.
_SPLIT_MIN = 1 << 16
# The cores this process may run on (a taskset or a container limit), not the machine's.
_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
_pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="deltaboard-scatter")


@intrinsic
def _load_intrinsic(typingctx: Any, addr: Any, like: Any) -> Any:
    """The element of `like`'s dtype at absolute address `addr`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        element = context.get_data_type(like.dtype)
        return builder.load(builder.inttoptr(args[0], element.as_pointer()), align=1)

    return like.dtype(types.int64, like), codegen


@intrinsic
def _store_intrinsic(typingctx: Any, addr: Any, value: Any) -> Any:
    """Store `value` (an integer of the element's width) at absolute address `addr`."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        element = context.get_data_type(value)
        builder.store(args[1], builder.inttoptr(args[0], element.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.int64, value), codegen


# Called only from compiled code, where numba types them; to Python they are opaque.
_load: Any = _load_intrinsic
_store: Any = _store_intrinsic


@numba.njit(cache=True, nogil=True)
def _swap(addrs: np.ndarray, expect: np.ndarray, put: np.ndarray, start: int, stop: int) -> int:
    """One pass: where memory holds `expect[j]`, write `put[j]`; at the first element that
    does not, write `expect` back over what this call wrote and return its index (-1: all
    swapped). A commit is one pass over the changed cache lines, not three."""
    for j in range(start, stop):
        a = addrs[j]
        if _load(a, expect) != expect[j]:
            for k in range(start, j):
                _store(addrs[k], expect[k])
            return j
        _store(a, put[j])
    return -1


def _split(n: int, fn: Callable[[int, int], Any]) -> list[tuple[int, int, Any]]:
    """`fn(a, b)` over ranges covering [0, n), on several threads for large n."""
    if n < _SPLIT_MIN or _THREADS == 1:
        return [(0, n, fn(0, n))]
    bounds = np.linspace(0, n, _THREADS + 1).astype(np.int64).tolist()
    futures = [(a, b, _pool.submit(fn, a, b)) for a, b in itertools.pairwise(bounds)]
    return [(a, b, f.result()) for a, b, f in futures]


def swap(addrs: np.ndarray, expect: np.ndarray, put: np.ndarray) -> int:
    """Replace `expect` by `put` at `addrs`, all or nothing: returns -1 when every element
    held `expect` and now holds `put`; otherwise the index of an element that did not, with
    memory left exactly as it was."""
    results = _split(addrs.size, lambda a, b: _swap(addrs, expect, put, a, b))
    bad = [j for _, _, j in results if j >= 0]
    if not bad:
        return -1
    for a, b, j in results:  # the ranges that swapped completely go back too
        if j < 0:
            _swap(addrs, put, expect, a, b)
    return int(min(bad))


def warm_up(bits: np.dtype[Any]) -> None:
    """Compile (or load from the disk cache) the loops for one element width, so that the
    first commit does not pay for it inside the engine's pause."""
    empty = np.empty(0, dtype=bits)
    _swap(np.empty(0, dtype=np.int64), empty, empty, 0, 0)
