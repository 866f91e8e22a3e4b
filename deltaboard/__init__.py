"""deltaboard: lossless weight synchronisation for RL post-training.

The public face of the project. Users import from here (`from deltaboard import
Publisher`); the role packages below it (`deltaboard.board`, `deltaboard.publisher`,
`deltaboard.clients`, `deltaboard.services`) hold the implementation.

Names are resolved on first use (PEP 562) so that importing one role never drags in
another's dependencies: the board server runs without torch, and `import deltaboard`
alone costs nothing.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaboard.board.codec import PatchError
    from deltaboard.board.contract.errors import (
        BoardError,
        BoardUnavailable,
        Conflict,
        Forbidden,
        InvalidRequest,
        LeaseHeld,
        NotFound,
        NotHead,
        StaleEpoch,
        Unauthorized,
        UnknownBase,
        UnknownRun,
        UnknownVersion,
    )
    from deltaboard.board.contract.schemas import ViewSpec
    from deltaboard.clients.board_client import BlobIntegrityError, BoardClient
    from deltaboard.clients.follower import (
        CorruptBase,
        DirectoryError,
        Follower,
        FollowerError,
        IntegrityError,
    )
    from deltaboard.publisher.hf_callback import DeltaboardCallback
    from deltaboard.publisher.publisher import Publisher

try:
    __version__ = version("deltaboard")
except PackageNotFoundError:  # a checkout used without installing it
    __version__ = "0+unknown"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "BlobIntegrityError": "deltaboard.clients.board_client",
    "BoardClient": "deltaboard.clients.board_client",
    "BoardError": "deltaboard.board.contract.errors",
    "BoardUnavailable": "deltaboard.board.contract.errors",
    "Conflict": "deltaboard.board.contract.errors",
    "CorruptBase": "deltaboard.clients.follower",
    "DeltaboardCallback": "deltaboard.publisher.hf_callback",
    "DirectoryError": "deltaboard.clients.follower",
    "Follower": "deltaboard.clients.follower",
    "FollowerError": "deltaboard.clients.follower",
    "Forbidden": "deltaboard.board.contract.errors",
    "IntegrityError": "deltaboard.clients.follower",
    "InvalidRequest": "deltaboard.board.contract.errors",
    "LeaseHeld": "deltaboard.board.contract.errors",
    "NotFound": "deltaboard.board.contract.errors",
    "NotHead": "deltaboard.board.contract.errors",
    "PatchError": "deltaboard.board.codec",
    "Publisher": "deltaboard.publisher.publisher",
    "StaleEpoch": "deltaboard.board.contract.errors",
    "Unauthorized": "deltaboard.board.contract.errors",
    "UnknownBase": "deltaboard.board.contract.errors",
    "UnknownRun": "deltaboard.board.contract.errors",
    "UnknownVersion": "deltaboard.board.contract.errors",
    "ViewSpec": "deltaboard.board.contract.schemas",
}

__all__ = [
    "BlobIntegrityError",
    "BoardClient",
    "BoardError",
    "BoardUnavailable",
    "Conflict",
    "CorruptBase",
    "DeltaboardCallback",
    "DirectoryError",
    "Follower",
    "FollowerError",
    "Forbidden",
    "IntegrityError",
    "InvalidRequest",
    "LeaseHeld",
    "NotFound",
    "NotHead",
    "PatchError",
    "Publisher",
    "StaleEpoch",
    "Unauthorized",
    "UnknownBase",
    "UnknownRun",
    "UnknownVersion",
    "ViewSpec",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'deltaboard' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
