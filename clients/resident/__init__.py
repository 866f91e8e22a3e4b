"""The resident view: the served weights held in the engine's own memory, patched in place.

A new version reaches a serving engine in two phases:

- **prepare**, while the engine keeps generating: the sidecar fetches the version's blobs,
  checks their sha256 and decodes each patch against the bytes the engine serves (the
  follower's served slot holds the same bits on disk), giving a `HotPatch`: per tensor the
  changed positions, their old bits and their new bits, verified by the codec against the
  held and the manifest's digests. The engine *stages* it (`ResidentView.stage`): bounds
  checks, one absolute address per changed element, and the arrays moved next to the
  weights (copied to the device for CUDA, where the addresses are computed).
- **commit**, between two forward passes (`ResidentView.commit`): every staged old value
  must be what the live memory holds (else nothing is written), the new values are
  scattered, and read back; a read-back mismatch restores the old values. The cost follows
  the changed elements, not the tensor count: one pass per element width over all tensors.

See `patch` for the staged form and its file, `view` for the engine side, `prepare` for
the decoding side, and `scatter` for the compiled loops.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from deltaboard.clients.resident.errors import BaseMismatch, ResidentError, StagingFull
from deltaboard.clients.resident.patch import HotPatch, TensorPatch, read_patch, write_patch
from deltaboard.clients.resident.prepare import prepare_patch

if TYPE_CHECKING:
    from deltaboard.clients.resident.view import CommitReport, ResidentView

# The engine-side names need torch; the follower's side (prepare) does not, so they load
# on first use.
_TORCH_NAMES = ("CommitReport", "ResidentView")


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        return getattr(importlib.import_module("deltaboard.clients.resident.view"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BaseMismatch",
    "CommitReport",
    "HotPatch",
    "ResidentError",
    "ResidentView",
    "StagingFull",
    "TensorPatch",
    "prepare_patch",
    "read_patch",
    "write_patch",
]
