"""`stream_copy`: a memory copy with non-temporal stores, for the snapshot of host tensors.

A large copy is memory-bound, and a plain one first reads every destination cache line in
before writing it (write-allocate): a third of its memory traffic is spent on bytes that
are about to be overwritten. Non-temporal stores write the destination around the caches.
numpy has no such copy, so this is a small numba loop over 64-byte lines, each stored by
an LLVM vector store marked `nontemporal`; it releases the GIL, so the snapshot's helper
thread (`deltaboard.publisher.snapshot.copy_shared`) copies beside the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


def _contiguous_bytes(array: Any) -> bool:
    return (
        isinstance(array, types.Array)
        and array.ndim == 1
        and array.layout == "C"
        and array.dtype == types.uint8
    )


@intrinsic
def _stream_line(typingctx: Any, dst: Any, src: Any, start: Any) -> Any:
    """Copy the 64 bytes at `start` with a non-temporal store: the destination line is
    written without being read into the cache first (the caller aligns `dst + start` to
    64 bytes and calls `_store_fence` after the last one)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        line = ir.VectorType(ir.IntType(64), 8)
        pointers = [
            builder.bitcast(
                builder.gep(context.make_array(t)(context, builder, a).data, [args[2]]), line.as_pointer()
            )
            for t, a in zip(signature.args[:2], args[:2], strict=True)
        ]
        store = builder.store(builder.load(pointers[1], align=1), pointers[0], align=64)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    if not (_contiguous_bytes(dst) and _contiguous_bytes(src)):
        return None
    return types.none(dst, src, start), codegen


@intrinsic
def _store_fence(typingctx: Any) -> Any:
    """Order the non-temporal stores before everything after (they are weakly ordered)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _address(typingctx: Any, array: Any) -> Any:
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    if not _contiguous_bytes(array):
        return None
    return types.uint64(array), codegen


@intrinsic
def _bytes_at(typingctx: Any, at: Any) -> Any:
    """A pointer to the bytes at the address `at` (for `numba.carray`)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.CPointer(types.uint8)(types.uint64), codegen  # type: ignore[no-untyped-call]


# The intrinsics as plain functions for the type checker (numba sees the same objects).
address = cast(Callable[[np.ndarray], np.uint64], _address)
bytes_at = cast(Callable[[np.uint64], Any], _bytes_at)
stream_line = cast(Callable[[np.ndarray, np.ndarray, int], None], _stream_line)
store_fence = cast(Callable[[], None], _store_fence)


@numba.njit(cache=True, nogil=True)
def _stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    n = dst.size
    head = min(n, int((np.uint64(64) - (address(dst) & np.uint64(63))) & np.uint64(63)))
    body = head + (n - head) // 64 * 64
    for i in range(head):
        dst[i] = src[i]
    for i in range(head, body, 64):
        stream_line(dst, src, i)
    for i in range(body, n):
        dst[i] = src[i]
    store_fence()


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src` for large buffers (uint8, same size), writing `dst` around the
    caches. The GIL is released."""
    if dst.shape != src.shape or dst.dtype != np.uint8 or src.dtype != np.uint8:
        raise ValueError("stream_copy copies between uint8 arrays of one size")
    _stream_copy(dst, src)


@numba.njit(cache=True, nogil=True)
def _gather_copy(dst: np.ndarray, starts: np.ndarray, addresses: np.ndarray, sizes: np.ndarray) -> None:
    for i in range(starts.size):
        src = numba.carray(bytes_at(addresses[i]), (sizes[i],))  # type: ignore[attr-defined]
        _stream_copy(dst[starts[i] : starts[i] + sizes[i]], src)


def gather_copy(dst: np.ndarray, starts: np.ndarray, addresses: np.ndarray, sizes: np.ndarray) -> None:
    """`stream_copy` of many sources at once: the `sizes[i]` bytes at memory address
    `addresses[i]` into `dst` (uint8) from `starts[i]` (int64 arrays, uint64 addresses).
    One compiled call for a batch of small tensors, each written around the caches: a
    plain copy of a few KB reads every destination line in first (the C library keeps
    its non-temporal stores for copies of megabytes). The caller keeps the sources alive
    and guarantees their bytes; the GIL is released."""
    if dst.dtype != np.uint8 or dst.ndim != 1 or not (starts.size == addresses.size == sizes.size):
        raise ValueError("gather_copy copies into a uint8 array, one start, address and size per source")
    if starts.size and ((starts < 0).any() or (starts + sizes > dst.size).any()):
        raise ValueError("gather_copy: a source does not fit in dst at its start")
    _gather_copy(dst, starts, addresses, sizes)
