"""Element widths of the safetensors dtypes.

The codec never interprets values as numbers: it compares and codes *bit patterns*, the
unsigned little-endian integers of each element's width. That is what makes it exact for
NaN payloads, -0/+0 and every dtype alike.
"""

from __future__ import annotations

import numpy as np

from deltaboard.board.codec.errors import PatchError
from deltaboard.board.contract.view_spec import DTYPE_WIDTHS

WIDTHS: dict[str, int] = DTYPE_WIDTHS
# Wire codes: the position in this tuple (the contract's order, append only).
DTYPE_NAMES: tuple[str, ...] = tuple(WIDTHS)
_UINTS: dict[int, np.dtype[np.unsignedinteger]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
    8: np.dtype("<u8"),
}


def width(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name."""
    try:
        return WIDTHS[dtype]
    except KeyError:
        raise PatchError(f"unsupported dtype {dtype!r}; expected one of {', '.join(WIDTHS)}") from None


def uint_dtype(dtype: str) -> np.dtype[np.unsignedinteger]:
    """The unsigned little-endian integer type holding one element's bits."""
    return _UINTS[width(dtype)]


def dtype_code(dtype: str) -> int:
    width(dtype)
    return DTYPE_NAMES.index(dtype)


def dtype_name(code: int) -> str:
    if not 0 <= code < len(DTYPE_NAMES):
        raise PatchError(f"unknown dtype code {code}")
    return DTYPE_NAMES[code]


def as_bits(data: np.ndarray, dtype: str, what: str = "tensor") -> np.ndarray:
    """View raw tensor bytes (1-D uint8) as element bit patterns, without copying."""
    if data.dtype != np.uint8 or data.ndim != 1:
        raise PatchError(f"{what} must be a 1-D uint8 array of raw bytes, got {data.dtype}{list(data.shape)}")
    w = width(dtype)
    if data.size % w:
        raise PatchError(f"{what} has {data.size} bytes, not a multiple of the {dtype} width {w}")
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data.view(_UINTS[w])
