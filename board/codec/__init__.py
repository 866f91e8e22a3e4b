"""The lossless patch codec: raw tensor bytes in, self-verifying patches out.

Pure numpy, no I/O, no torch (the board server imports it). See docs/contract.md §1,
`board.codec.api` for the choice of encodings, `board.codec.header` for the patch layout,
`board.codec.values` and `board.codec.classes` for the context coding, and
`board.codec.digest` for the additive digest.
"""

from board.codec.api import apply, decode, encode, encode_changes, keyframe, read_header
from board.codec.changes import Changes, diff, empty_changes
from board.codec.digest import digest, digest_bits, digest_update, state_digest
from board.codec.dtypes import WIDTHS, uint_dtype, width
from board.codec.errors import PatchError
from board.codec.header import ENCODINGS, PatchHeader
from board.codec.ranked import ContextHint, context_hint

__all__ = [
    "ENCODINGS",
    "WIDTHS",
    "Changes",
    "ContextHint",
    "PatchError",
    "PatchHeader",
    "apply",
    "context_hint",
    "decode",
    "diff",
    "digest",
    "digest_bits",
    "digest_update",
    "empty_changes",
    "encode",
    "encode_changes",
    "keyframe",
    "read_header",
    "state_digest",
    "uint_dtype",
    "width",
]
