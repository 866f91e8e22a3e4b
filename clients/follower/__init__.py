"""The rollout follower: a local Hugging Face checkpoint kept at an exact version.

See `follower` for the update steps, `slots` for what readers see and the disk cost,
`journal` for crash safety and `verify` for the full re-hash.
"""

from deltaboard.clients.follower.errors import CorruptBase, DirectoryError, FollowerError, IntegrityError
from deltaboard.clients.follower.follower import CommitHook, Follower, Progress, swap_now

__all__ = [
    "CommitHook",
    "CorruptBase",
    "DirectoryError",
    "Follower",
    "FollowerError",
    "IntegrityError",
    "Progress",
    "swap_now",
]
