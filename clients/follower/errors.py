"""The follower's failures, by what an operator must do about them."""

from __future__ import annotations


class FollowerError(RuntimeError):
    """The follower could not reach the version it was asked for.

    The served version is untouched whenever this is raised: every change happens in the
    staging slot, which only becomes current after it verified.
    """


class IntegrityError(FollowerError):
    """Bytes from the board did not match what the manifest promises, even after one refetch.

    Either the board's store is corrupted or something between the board and this node
    alters data: retrying blindly would not help, so this fails loudly.
    """


class DirectoryError(FollowerError):
    """The target directory is not a follower directory (or belongs to another run)."""
