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


class UnusableManifest(FollowerError):
    """A version's manifest breaks the contract (an unknown dtype, a negative shape, a path
    for a file name: one stored by an older, laxer board): no retry can apply it."""


class DirectoryError(FollowerError):
    """The target directory is not a follower directory (or belongs to another run)."""


class CorruptBase(FollowerError):
    """A slot's bytes are not the ones its journal records: bit rot, or a write from outside.

    Found where an update reads a slot it is about to patch (the base): a patch's result
    digest that fails only because the slot's bits are wrong, or the served slot's bits at
    the changed positions differing from the verified staging slot's. Nothing is written to
    the damaged slot and nothing new is served. Retrying cannot fix it: `Follower.repair()`
    (`deltaboard pull --repair`) rebuilds the damaged slot, from the other one or the board.
    """

    def __init__(self, message: str, tensors: list[str]) -> None:
        super().__init__(f"{message}; run `deltaboard pull --repair` (Follower.repair()) to rebuild it")
        self.tensors = tensors
