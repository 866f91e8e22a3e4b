"""What can stop a hot update; each leaves the resident view as it was."""

from __future__ import annotations


class ResidentError(RuntimeError):
    """A hot update cannot be applied to the resident view; the view is unchanged."""


class StagingFull(ResidentError):
    """The patch needs more staging memory than allowed: apply it by a reload instead."""


class BaseMismatch(ResidentError):
    """The live weights are not the patch's base at a changed element: nothing was written."""
