"""The lossless patch codec: raw tensor bytes in, self-verifying patches out.

Pure numpy, no I/O, no torch. See docs/contract.md §1, `api` for the choice of encodings,
`header` for the patch layout, `values` and `classes` for the context coding, and `digest`
for the additive digest.
"""

from deltaboard.board.codec.api import apply, decode, encode, encode_changes, keyframe, read_header
from deltaboard.board.codec.changes import Changes, diff, empty_changes
from deltaboard.board.codec.digest import digest, digest_bits, digest_update, state_digest
from deltaboard.board.codec.dtypes import WIDTHS, uint_dtype, width
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.header import ENCODINGS, PatchHeader
from deltaboard.board.codec.ranked import ContextHint, context_hint

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
