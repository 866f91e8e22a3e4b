"""The compiled loops on host memory: stage (check and address) and commit (swap) by address.

Every changed element of every tensor of one width is addressed absolutely (the tensor's
data pointer plus position times width), so one loop covers all tensors: the cost of a
commit follows the changed elements, not the number of tensors. numba reads and writes
those addresses through small LLVM intrinsics (`inttoptr` + load/store, and a prefetch);
the addresses are computed and bounds-checked by `address` against tensors the view holds
references to, never taken from input.

The swap is bound by memory, not arithmetic: at 1% changed a quarter of the view's cache
lines are each read and written once, in increasing address order but too sparsely for
the hardware prefetcher to follow, so a loop that waits for each line in turn spends its
time on memory latency. The loop therefore asks for the line of the element `_AHEAD`
changes ahead (with the intent to write) while it swaps the current one, which keeps
several lines in flight per core. How many lines are in flight is bounded by how many
changes fit in the core's reorder window, so the loop is kept to a dozen instructions a
change: it runs over slices from 0 (indices the compiler proves non-negative, so no
wrap-around check on every read) and prefetches outside any branch, leaving the last
`_AHEAD` changes to a second loop without prefetch.

Large passes are spread over the process's cores (the loops release the GIL) in chunks
that the calling thread and the pool's threads claim in turn (`_spread`), not in one fixed
share per thread: on a busy machine a thread that gets no core for a while leaves its
chunks to the threads that run, so a pass takes what the running threads need instead of
waiting for the slowest thread's share; the calling thread, already running, is one of
them, so a pass never waits for a thread to wake up before it starts.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

# Below this many elements a second thread costs more than it saves.
_SPLIT_MIN = 1 << 16
# Chunks per thread in a spread pass: enough that a thread kept off its core leaves most
# of its share to the others, and that the threads that finish first wait little for the
# last chunk (a pass ends when its last chunk does: on two cores, half a chunk's time on
# average); few enough that claiming them (a call from Python each, about a microsecond)
# costs nothing next to the pass.
_CHUNKS_PER_THREAD = 32
# The cores this process may run on (a taskset or a container limit), not the machine's.
_CORES = len(os.sched_getaffinity(0))
_THREADS = max(1, min(4, _CORES))
# A CUDA view's staging pass runs while the engine computes on the GPU, its host cores
# mostly idle: more threads pay there (8 GB view, 42.9M changes, on the H200's host:
# 4 threads 87-92 ms, 8 threads 55-59, 16 threads 70-74; docs/design.md, "Hot updates").
WIDE_THREADS = max(1, min(8, _CORES))
_pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="deltaboard-scatter")
_wide_pool = ThreadPoolExecutor(WIDE_THREADS, thread_name_prefix="deltaboard-stage")
# How many changes ahead the swap asks for a line: far enough to cover memory latency at
# a few nanoseconds per change, near enough that the line is still cached when reached
# (the chosen distance is measured in docs/design.md, "Hot updates").
_AHEAD = 16


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


@intrinsic
def _prefetch_intrinsic(typingctx: Any, addr: Any) -> Any:
    """Ask for the cache line at absolute address `addr`, to be written (a hint: no fault,
    no effect on results)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i32 = ir.IntType(32)
        pointer = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        prefetch = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
            builder.module, ir.FunctionType(ir.VoidType(), [pointer.type, i32, i32, i32]), "llvm.prefetch.p0"
        )
        # write intent, keep in all cache levels, data cache
        builder.call(prefetch, [pointer, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


# Called only from compiled code, where numba types them; to Python they are opaque.
_load: Any = _load_intrinsic
_store: Any = _store_intrinsic
_prefetch: Any = _prefetch_intrinsic


@numba.njit(cache=True, nogil=True, inline="always")
def _swap_one(addrs: np.ndarray, expect: np.ndarray, put: np.ndarray, k: int) -> bool:
    """Where memory holds `expect[k]`, write `put[k]` and return True; else False."""
    a = addrs[k]
    if _load(a, expect) != expect[k]:
        return False
    _store(a, put[k])
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _undo(addrs: np.ndarray, expect: np.ndarray, count: int) -> int:
    """Write `expect` back over the first `count` elements; returns `count`."""
    for k in range(count):
        _store(addrs[k], expect[k])
    return count


@numba.njit(cache=True, nogil=True)
def _swap(addrs: np.ndarray, expect: np.ndarray, put: np.ndarray, start: int, stop: int) -> int:
    """One pass: where memory holds `expect[j]`, write `put[j]`; at the first element that
    does not, write `expect` back over what this call wrote and return its index (-1: all
    swapped). A commit is one pass over the changed cache lines, not three."""
    a, e, p = addrs[start:stop], expect[start:stop], put[start:stop]
    ahead = max(0, a.size - _AHEAD)
    for k in range(ahead):
        _prefetch(a[k + _AHEAD])
        if not _swap_one(a, e, p, k):
            return start + _undo(a, e, k)
    for k in range(ahead, a.size):
        if not _swap_one(a, e, p, k):
            return start + _undo(a, e, k)
    return -1


@numba.njit(cache=True, nogil=True)
def _put(addrs: np.ndarray, values: np.ndarray, start: int, stop: int) -> int:
    """Store `values[j]` at `addrs[j]` for j in [start, stop), with the swap's prefetch
    and no check."""
    a, v = addrs[start:stop], values[start:stop]
    ahead = max(0, a.size - _AHEAD)
    for k in range(ahead):
        _prefetch(a[k + _AHEAD])
        _store(a[k], v[k])
    for k in range(ahead, a.size):
        _store(a[k], v[k])
    return -1


@numba.njit(cache=True, nogil=True)
def _address(
    positions: np.ndarray,
    ends: np.ndarray,
    numels: np.ndarray,
    ptrs: np.ndarray,
    width: int,
    start: int,
    stop: int,
    addrs: np.ndarray,
    old: np.ndarray,
    new: np.ndarray,
    old_out: np.ndarray,
    new_out: np.ndarray,
) -> int:
    """Elements [start, stop) of a width group: each position must lie inside its tensor
    and increase within it; its absolute address goes to `addrs[j - start]` and, when
    `old_out` is not empty, its bits to `old_out` / `new_out` at the same index. Returns
    -1, or the index of the first element that fails."""
    t = np.searchsorted(ends, start, side="right")
    first = ends[t - 1] if t > 0 else 0
    copy = old_out.size > 0
    for j in range(start, stop):
        while j >= ends[t]:
            first = ends[t]
            t += 1
        p = positions[j]
        if p < 0 or p >= numels[t] or (j > first and p <= positions[j - 1]):
            return j
        addrs[j - start] = ptrs[t] + p * width
        if copy:
            old_out[j - start] = old[j]
            new_out[j - start] = new[j]
    return -1


def _spread(n: int, fn: Callable[[int, int], int], wide: bool = False) -> list[tuple[int, int, int]]:
    """`fn(a, b)` over chunks covering [0, n), claimed in turn by the calling thread and the
    pool's threads (`_THREADS` of them, `WIDE_THREADS` if `wide`), until none is left or a
    chunk fails (returns an index >= 0): then no further chunk starts. Returns (a, b,
    result) of every chunk that ran; the chunks that never ran were not touched. Chunks are
    claimed in increasing order and a claimed chunk runs to its end, so the smallest failing
    index returned is the first of the pass."""
    threads, pool = (WIDE_THREADS, _wide_pool) if wide else (_THREADS, _pool)
    if n < _SPLIT_MIN or threads == 1:
        return [(0, n, fn(0, n))]
    step = max(_SPLIT_MIN // 2, -(-n // (threads * _CHUNKS_PER_THREAD)))
    starts = range(0, n, step)
    claims = itertools.count()  # next() on it is atomic: each chunk goes to one thread
    ran: list[tuple[int, int, int]] = []
    failed = threading.Event()

    def work() -> None:
        while not failed.is_set():
            k = next(claims)
            if k >= len(starts):
                return
            a = starts[k]
            b = min(n, a + step)
            result = fn(a, b)
            ran.append((a, b, result))
            if result >= 0:
                failed.set()

    helpers = [pool.submit(work) for _ in range(threads - 1)]
    try:
        work()
    finally:
        for helper in helpers:
            # the calling thread is out of chunks (or a failure stopped the pass): a helper
            # that has not started yet (no core for it so far) is dropped, not waited for;
            # one that has started is finishing the chunk it claimed
            if not helper.cancel():
                helper.result()
    return ran


def swap(addrs: np.ndarray, expect: np.ndarray, put: np.ndarray) -> int:
    """Replace `expect` by `put` at `addrs`, all or nothing: returns -1 when every element
    held `expect` and now holds `put`; otherwise the index of an element that did not, with
    memory left exactly as it was."""
    results = _spread(addrs.size, lambda a, b: _swap(addrs, expect, put, a, b))
    bad = [j for _, _, j in results if j >= 0]
    if not bad:
        return -1
    for a, b, j in results:  # the chunks that swapped completely go back too
        if j < 0:
            _swap(addrs, put, expect, a, b)
    return int(min(bad))


def put(addrs: np.ndarray, values: np.ndarray) -> None:
    """Store `values` at `addrs`, unchecked, spread over the same threads and prefetched as
    `swap`: the floor of a scatter of the same changes, which `bench update` measures the
    swap against (a store pass lets the core run ahead of its misses; the swap must read
    each line before it writes it; without the prefetch the store pass was faster on one
    host and slower than the swap on another). The view never calls it: a commit is
    always checked."""
    _spread(addrs.size, lambda a, b: _put(addrs, values, a, b))


def address(
    positions: np.ndarray,
    ends: np.ndarray,
    numels: np.ndarray,
    ptrs: np.ndarray,
    width: int,
    start: int,
    stop: int,
    out: tuple[np.ndarray, np.ndarray, np.ndarray],
    bits: tuple[np.ndarray, np.ndarray],
    wide: bool = False,
) -> int:
    """Check and address elements [start, stop) of a width group (tensor `t` holds the
    elements before `ends[t]`, at `ptrs[t]`, of `numels[t]` elements) into `out` =
    (addresses, old bits, new bits), indexed from `start`; `bits` (old, new) are copied
    only where `out`'s bit arrays are not empty; `wide`: on `WIDE_THREADS` threads. -1
    when every element is valid, else the index of the first that is not (what was
    written is then of no use)."""
    addrs, old_out, new_out = out
    old, new = bits

    def part(a: int, b: int) -> int:
        return _address(
            positions, ends, numels, ptrs, width, start + a, start + b,
            addrs[a:], old, new, old_out[a:], new_out[a:],
        )  # fmt: skip

    bad = [j for _, _, j in _spread(stop - start, part, wide) if j >= 0]
    return min(bad) if bad else -1


def warm_up(bits: np.dtype[Any]) -> None:
    """Compile (or load from the disk cache) the loops for one element width, so that the
    first commit does not pay for it inside the engine's pause, nor the first staging."""
    empty, none = np.empty(0, dtype=bits), np.empty(0, dtype=np.int64)
    _swap(none, empty, empty, 0, 0)
    _address(none, np.ones(1, dtype=np.int64), none, none, 1, 0, 0, none, empty, empty, empty, empty)
