"""The lossless patch codec: raw tensor bytes in, self-verifying patches out.

Pure numpy, no I/O, no torch. See docs/contract.md §1, `api` for the choice of encodings,
`header` for the patch layout, `values` and `classes` for the context coding, and `digest`
for the additive digest.

Two APIs: the operations (`diff`, `encode_changes`, `apply`, ...) and the planning rules
of the `context` encoding (`EXPONENT_FIELDS`, `sample_stride`, `exponent_counts`,
`plan_thresholds`, or `plan_thresholds_many` for many tensors at once, `class_limits`),
which a second implementation of `context_hint` (the publisher's device diff) follows to
produce the same `ContextHint`; the docstring of `plan_thresholds` states that contract
step by step.
"""

from deltaboard.board.codec.api import (
    apply,
    decode,
    encode,
    encode_changes,
    keyframe,
    keyframe_into,
    read_header,
)
from deltaboard.board.codec.batch import PatchBatch, encode_batch
from deltaboard.board.codec.changes import Changes, diff, empty_changes
from deltaboard.board.codec.columns import ChangeColumns, HintColumns
from deltaboard.board.codec.context import (
    EXPONENT_FIELDS,
    class_limits,
    exponent_counts,
    plan_thresholds,
    plan_thresholds_many,
    sample_stride,
)
from deltaboard.board.codec.digest import (
    combine_digests,
    digest,
    digest_bits,
    digest_slice,
    digest_update,
    slice_positions,
    sorted_state_digest,
    state_digest,
)
from deltaboard.board.codec.dtypes import WIDTHS, uint_dtype, width
from deltaboard.board.codec.errors import PatchError
from deltaboard.board.codec.header import ENCODINGS, PatchHeader
from deltaboard.board.codec.ranked import ContextHint, context_hint
from deltaboard.board.codec.span import compose

__all__ = [
    "ENCODINGS",
    "EXPONENT_FIELDS",
    "WIDTHS",
    "ChangeColumns",
    "Changes",
    "ContextHint",
    "HintColumns",
    "PatchBatch",
    "PatchError",
    "PatchHeader",
    "apply",
    "class_limits",
    "combine_digests",
    "compose",
    "context_hint",
    "decode",
    "diff",
    "digest",
    "digest_bits",
    "digest_slice",
    "digest_update",
    "empty_changes",
    "encode",
    "encode_batch",
    "encode_changes",
    "exponent_counts",
    "keyframe",
    "keyframe_into",
    "plan_thresholds",
    "plan_thresholds_many",
    "read_header",
    "sample_stride",
    "slice_positions",
    "sorted_state_digest",
    "state_digest",
    "uint_dtype",
    "width",
]
