"""The codec's compiled loops: numba, compiled on first use and cached on disk.

Why compiled: per changed element the codec does a handful of integer operations with
data-dependent control (bit streams, rank and select within classes). As numpy passes each
step streams a fresh temporary through memory and pays a call per array; one compiled loop
does the same work in registers, several times faster, which is what the throughput
targets (GB of view per second on two cores) need.

Besides `kernel`, this module holds the few LLVM intrinsics the kernels need (popcount,
64-lane compares straight into bit masks) and `stream_copy`, a copy with non-temporal
stores that the publisher's snapshot uses for the same reason: memory-bound passes at
memory speed.

`kernel` compiles with `nogil`, so the codec's thread pools (`deltaboard.board.codec.parallel`, and
callers that code several tensors at once) run kernels on every core. numba does not check
array bounds: kernels that read coded (untrusted) streams check every index themselves and
report failure through their return value, which the Python side turns into `PatchError`.

numba's disk cache is keyed on each kernel's own source file, not on what it calls: after
changing an intrinsic here, delete `board/codec/__pycache__/*.nb[ic]` so that the kernels
of the other modules are compiled again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros
from numba.extending import intrinsic

F = TypeVar("F", bound=Callable[..., Any])


def kernel(fn: F) -> F:
    """Compile `fn` (nopython, GIL released, cached next to its module)."""
    return cast(F, numba.njit(cache=True, nogil=True)(fn))


@intrinsic
def _popcount(typingctx: Any, x: Any) -> Any:
    """Set bits of an unsigned integer (LLVM ctpop: one instruction on x86-64 with popcnt)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.ctpop(args[0])

    return x(x), codegen


def _contiguous(array: Any) -> bool:
    return isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C"


def _lane_vector(context: Any, builder: Any, array_type: Any, array: Any, start: Any) -> Any:
    """The 64 elements of `array` from `start`, as one LLVM vector."""
    data = context.make_array(array_type)(context, builder, array).data
    lanes = ir.VectorType(context.get_data_type(array_type.dtype), 64)
    return builder.load(builder.bitcast(builder.gep(data, [start]), lanes.as_pointer()), align=1)


@intrinsic
def _below_mask(typingctx: Any, array: Any, start: Any, limit: Any) -> Any:
    """Bit j set where the sign-less bits of `array[start + j]` are below `limit`, for
    j < 64 (the caller guarantees 64 elements from `start`).

    One vector compare whose lane mask is the result: LLVM lowers it to a few AVX-512
    compares straight into a mask register (or their SSE/AVX2 equivalents), which keeps
    the passes over the old tensor at memory speed; a scalar loop building the same mask
    bit by bit costs about ten times more.
    """

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        vector = _lane_vector(context, builder, signature.args[0], args[0], args[1])
        lanes = vector.type
        width = lanes.element.width
        magnitude = builder.and_(vector, ir.Constant(lanes, [(1 << (width - 1)) - 1] * 64))
        first = ir.Constant(ir.IntType(32), 0)
        one = builder.insert_element(ir.Constant(lanes, ir.Undefined), args[2], first)
        splat = builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))
        return builder.bitcast(builder.icmp_unsigned("<", magnitude, splat), ir.IntType(64))

    if not _contiguous(array) or limit != array.dtype:
        return None
    return types.uint64(array, start, limit), codegen


@intrinsic
def _differ_mask(typingctx: Any, a: Any, b: Any, start: Any) -> Any:
    """Bit j set where `a[start + j] != b[start + j]`, for j < 64 (as `below_mask`)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x = _lane_vector(context, builder, signature.args[0], args[0], args[2])
        y = _lane_vector(context, builder, signature.args[1], args[1], args[2])
        return builder.bitcast(builder.icmp_unsigned("!=", x, y), ir.IntType(64))

    if not (_contiguous(a) and _contiguous(b) and a.dtype == b.dtype):
        return None
    return types.uint64(a, b, start), codegen


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

    if not (_contiguous(dst) and _contiguous(src) and dst.dtype == src.dtype == types.uint8):
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

    if not _contiguous(array):
        return None
    return types.uint64(array), codegen


# The intrinsics as plain functions for the type checker (numba sees the same objects).
Word = np.uint64
popcount = cast(Callable[[Word], Word], _popcount)
leading_zeros = cast(Callable[[Word], Word], _leading_zeros)
trailing_zeros = cast(Callable[[Word], Word], _trailing_zeros)
below_mask = cast(Callable[[np.ndarray, int, np.generic], Word], _below_mask)
differ_mask = cast(Callable[[np.ndarray, np.ndarray, int], Word], _differ_mask)
address = cast(Callable[[np.ndarray], Word], _address)
stream_line = cast(Callable[[np.ndarray, np.ndarray, int], None], _stream_line)
store_fence = cast(Callable[[], None], _store_fence)


@kernel
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
    caches: a plain copy first reads every destination line in (write-allocate), a third
    of the memory traffic of a copy that is memory-bound (measured 57 -> 46 ms for 1 GB
    on two cores here). The GIL is released."""
    if dst.shape != src.shape or dst.dtype != np.uint8 or src.dtype != np.uint8:
        raise ValueError("stream_copy copies between uint8 arrays of one size")
    _stream_copy(dst, src)
