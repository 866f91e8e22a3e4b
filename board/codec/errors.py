"""The one error the codec raises for anything wrong with a patch or its base."""


class PatchError(ValueError):
    """A patch cannot be applied: wrong base, corrupted, truncated, wrong dtype or size.

    It is a `ValueError` so that callers that validate input generically still catch it;
    the message says which check failed so that an operator can tell bit rot from a
    follower holding the wrong version.
    """
