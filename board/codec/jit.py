"""The codec's compiled loops: numba, compiled on first use and cached on disk.

Why compiled: per changed element the codec does a handful of integer operations with
data-dependent control (bit streams, rank and select within classes). As numpy passes each
step streams a fresh temporary through memory and pays a call per array; one compiled loop
does the same work in registers, which is what the throughput targets need.

Besides `kernel`, this module holds the few LLVM intrinsics the kernels need (popcount,
64-lane compares straight into bit masks, big-endian word loads, BMI2's bit deposit where
it is fast).

`kernel` compiles with `nogil`, so the codec's thread pools (`deltaboard.board.codec.parallel`, and
callers that code several tensors at once) run kernels on every core. numba does not check
array bounds: kernels that read coded (untrusted) streams check every index themselves and
report failure through their return value, which the Python side turns into `PatchError`.

numba's disk cache is keyed on each kernel's own source file, not on what it calls, and
kernels call kernels of other modules (the encoders write through `bitio`'s `put_*`, the
host's context hint runs `context.plan` and `classes.ranks_within`): so importing this
module drops compiled kernels that were written under other sources of this directory
(`kernel_cache`), before any kernel loads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import llvmlite.binding
import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.cpython.unsafe.numbers import leading_zeros as _leading_zeros
from numba.cpython.unsafe.numbers import trailing_zeros as _trailing_zeros
from numba.extending import intrinsic

from deltaboard.board.codec import kernel_cache

F = TypeVar("F", bound=Callable[..., Any])

kernel_cache.ensure_fresh(Path(__file__).parent)


def kernel(fn: F) -> F:
    """Compile `fn` (nopython, GIL released, cached next to its module)."""
    return cast(F, numba.njit(cache=True, nogil=True)(fn))


def inlined(fn: F) -> F:
    """`kernel`, and inlined into the kernels that call it (numba's own inlining, before
    LLVM's): for the steps of a per-word loop and the bit field reader, which LLVM kept as
    calls that passed their tuples through memory and counted references to their arrays
    on every call. Each inlined copy is typed and compiled again, so only those: the Rice
    reader (`bitio.next_value`), which LLVM inlines itself, stays a `kernel` (inlined by
    numba too, the codec took much longer to compile)."""
    return cast(F, numba.njit(cache=True, nogil=True, inline="always")(fn))


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
    the passes over the old tensor at memory speed, where a scalar loop builds the same
    mask bit by bit.
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
def _word_be(typingctx: Any, array: Any, start: Any) -> Any:
    """The 8 bytes of a uint8 `array` from byte `start` as one big-endian word: one
    unaligned load and a byte swap (the caller guarantees 8 bytes from `start`). Built
    from eight byte loads instead, numba kept a negative-index check on each and LLVM
    did not combine them, which put ~20 instructions on every bit reader's path."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        word = ir.IntType(64)
        loaded = builder.load(builder.bitcast(builder.gep(data, [args[1]]), word.as_pointer()), align=1)
        return builder.bswap(loaded)

    if not _contiguous(array) or array.dtype != types.uint8 or not isinstance(start, types.Integer):
        return None
    return types.uint64(array, start), codegen


def _fast_deposit() -> bool:
    """Whether the compiled code may use BMI2's `pdep` and it is fast: an x86-64 host with
    BMI2 whose code numba compiles for the host itself (not `NUMBA_CPU_NAME`), and not AMD
    before Zen 3, where `pdep` is microcoded (tens to hundreds of cycles)."""
    if getattr(numba.config, "CPU_NAME", None) is not None:
        return False
    name = llvmlite.binding.get_host_cpu_name()
    features = llvmlite.binding.get_host_cpu_features()
    return bool(features.get("bmi2")) and name not in ("znver1", "znver2")


FAST_DEPOSIT = _fast_deposit()


@intrinsic
def _deposit(typingctx: Any, x: Any, mask: Any) -> Any:
    """BMI2 `pdep`: the low bits of `x` scattered to the set bits of `mask`, in order (one
    instruction: the k-th set bit of a word is `deposit(1 << k, word)`). Only where
    `FAST_DEPOSIT`: elsewhere the instruction may not exist."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64 = ir.IntType(64)
        name = "llvm.x86.bmi.pdep.64"
        pdep = builder.module.globals.get(name) or ir.Function(
            builder.module, ir.FunctionType(i64, [i64, i64]), name
        )
        return builder.call(pdep, args)

    if x != types.uint64 or mask != types.uint64:
        return None
    return types.uint64(x, mask), codegen


# The intrinsics as plain functions for the type checker (numba sees the same objects).
Word = np.uint64
popcount = cast(Callable[[Word], Word], _popcount)
leading_zeros = cast(Callable[[Word], Word], _leading_zeros)
trailing_zeros = cast(Callable[[Word], Word], _trailing_zeros)
below_mask = cast(Callable[[np.ndarray, int, np.generic], Word], _below_mask)
differ_mask = cast(Callable[[np.ndarray, np.ndarray, int], Word], _differ_mask)
word_be = cast(Callable[[np.ndarray, int], Word], _word_be)
deposit = cast(Callable[[Word, Word], Word], _deposit)
