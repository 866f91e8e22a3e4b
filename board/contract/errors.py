"""The board's error vocabulary, shared by the server (which raises it) and the client
(which rebuilds it from the JSON body), so both sides name failures the same way.

No I/O, no framework and no HTTP status: the API edge (`board.server.api.errors`) holds
the one table from code to status, and the client (`clients.board_client`) keeps the
status it received in `http_status`. Each code of `ErrorCode` maps to one class
(`error_class`); callers branch on the class (`except NotHead:`), never on code strings.
The classes, by what the caller does about them:

    BoardError                  the board refused a request: .code, .message, .extra
    ├── InvalidRequest          the request is malformed: fix the caller, do not retry
    │   │                       (also MalformedJSON, ValidationError, BadRunName,
    │   │                       BadAssetName, BadDigest, BadRange, IncompleteBody,
    │   │                       UnsupportedEncoding, ...)
    │   ├── BodyTooLarge        the body exceeds the board's limit
    │   ├── DigestMismatch      an uploaded body does not hash to its key: upload again
    │   ├── BadManifest         the manifest breaks a version rule
    │   └── MissingBlobs        upload `.extra["missing"]`, then commit again
    ├── AuthError
    │   ├── Unauthorized        no valid token: configure one
    │   └── Forbidden           the token lacks the scope on this run
    ├── NotFound                no such route (and the base of what is not there)
    │   ├── UnknownRun          create the run, or wait for the trainer to
    │   ├── UnknownAsset
    │   ├── UnknownBlob
    │   ├── UnknownVersion      not committed yet, or pruned
    │   ├── UnknownBase         the base is pruned: bootstrap (`.extra["bootstrap"]`)
    │   ├── NoVersions          the run has no committed version yet
    │   ├── NoChain             no keyframe chain reaches the version
    │   └── UnknownPrepared     the board no longer holds a prepared manifest: commit it whole
    ├── Conflict                the board's state moved under the request
    │   ├── NotHead             another version landed first: re-read the head
    │   ├── StaleEpoch          this writer was fenced off: stop, or take a new lease
    │   ├── NoLease             take a lease before committing
    │   ├── LeaseHeld           another holder's lease is live: wait for it or steal it
    │   └── Contended           a record kept changing: retry
    ├── BoardUnavailable        the board failed (5xx after the client's retries): retry later
    │   ├── StoreUnavailable    the board cannot reach its object store: retry later
    │   └── IndexUnavailable    the board cannot reach its index (Redis): retry later
    └── InvalidResponse         the board's answer breaks the contract (a stored record
                                it cannot read): retrying does not help, report it

A code the client does not know (a newer board) becomes a plain `BoardError`. Two codes
are never sent by a board: the client assigns them (`CLIENT_CODES`).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, ClassVar


class ErrorCode(StrEnum):
    """Every `code` the board puts in an error body."""

    # the request is malformed
    BAD_REQUEST = "BadRequest"
    MALFORMED_JSON = "MalformedJSON"
    VALIDATION_ERROR = "ValidationError"
    BAD_RUN_NAME = "BadRunName"
    BAD_ASSET_NAME = "BadAssetName"
    BAD_DIGEST = "BadDigest"
    BAD_RANGE = "BadRange"
    INCOMPLETE_BODY = "IncompleteBody"
    METHOD_NOT_ALLOWED = "MethodNotAllowed"
    LENGTH_REQUIRED = "LengthRequired"
    RANGE_NOT_SATISFIABLE = "RangeNotSatisfiable"
    BODY_TOO_LARGE = "BodyTooLarge"
    UNSUPPORTED_ENCODING = "UnsupportedEncoding"
    DIGEST_MISMATCH = "DigestMismatch"
    BAD_MANIFEST = "BadManifest"
    MISSING_BLOBS = "MissingBlobs"
    # who is asking
    UNAUTHORIZED = "Unauthorized"
    FORBIDDEN = "Forbidden"
    # what is not there
    NOT_FOUND = "NotFound"
    UNKNOWN_RUN = "UnknownRun"
    UNKNOWN_ASSET = "UnknownAsset"
    UNKNOWN_BLOB = "UnknownBlob"
    UNKNOWN_VERSION = "UnknownVersion"
    UNKNOWN_BASE = "UnknownBase"
    NO_VERSIONS = "NoVersions"
    NO_CHAIN = "NoChain"
    UNKNOWN_PREPARED = "UnknownPrepared"
    # the board's state moved
    NOT_HEAD = "NotHead"
    STALE_EPOCH = "StaleEpoch"
    NO_LEASE = "NoLease"
    LEASE_HELD = "LeaseHeld"
    CONTENDED = "Contended"
    # the board failed
    INTERNAL = "Internal"
    STORE_UNAVAILABLE = "StoreUnavailable"
    INDEX_UNAVAILABLE = "IndexUnavailable"
    # assigned by the client, never sent: an HTTP failure without a board code of its own
    # (an unusual status from the framework, or a body that is not the board's JSON), and
    # an answer that does not match the contract's schema
    HTTP_ERROR = "HTTPError"
    INVALID_RESPONSE = "InvalidResponse"


# The codes a client assigns to what it received; no board sends them.
CLIENT_CODES = frozenset({ErrorCode.HTTP_ERROR, ErrorCode.INVALID_RESPONSE})


class BoardError(Exception):
    """A failure with a stable `code` (e.g. `NotHead`), a message and optional details.

    A subclass knows its code (`default_code`); a class standing for several codes
    (`InvalidRequest`, `BoardUnavailable`) or a plain `BoardError` takes `code=`.
    `http_status` is the status a client received (None for an error raised in-process).
    """

    default_code: ClassVar[ErrorCode | None] = None

    def __init__(
        self, message: str, *, code: str | None = None, http_status: int | None = None, **extra: Any
    ) -> None:
        chosen = code if code is not None else self.default_code
        if chosen is None:
            raise TypeError(f"{type(self).__name__} needs a code")
        self.code = str(chosen)
        self.message = message
        self.http_status = http_status
        self.extra = extra
        prefix = "" if http_status is None else f"{http_status} "
        super().__init__(f"{prefix}{self.code}: {message}")

    def body(self) -> dict[str, Any]:
        """The JSON error body of the contract: `{"error": {"code", "message", ...}}`."""
        return {"error": {"code": self.code, "message": self.message, **self.extra}}

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: rebuild from the attributes (pickling across processes).
        return (_rebuild, (type(self), self.message, self.code, self.http_status, self.extra))


def _rebuild(
    cls: type[BoardError], message: str, code: str, http_status: int | None, extra: dict[str, Any]
) -> BoardError:
    return cls(message, code=code, http_status=http_status, **extra)


# ---- the request is malformed ----------------------------------------------------------


class InvalidRequest(BoardError):
    """The request is malformed (bad JSON, name, digest, range, ...): retrying it as is
    cannot succeed."""

    default_code = ErrorCode.BAD_REQUEST


class BodyTooLarge(InvalidRequest):
    default_code = ErrorCode.BODY_TOO_LARGE


class DigestMismatch(InvalidRequest):
    """An uploaded body does not hash to the sha256 it was sent under."""

    default_code = ErrorCode.DIGEST_MISMATCH


class BadManifest(InvalidRequest):
    """The manifest breaks a rule of its own (run, parent, kind, tensor names, ranges)."""

    default_code = ErrorCode.BAD_MANIFEST


class MissingBlobs(InvalidRequest):
    """The manifest references blobs the board does not hold (`extra["missing"]`)."""

    default_code = ErrorCode.MISSING_BLOBS


# ---- who is asking ---------------------------------------------------------------------


class AuthError(BoardError):
    """The caller may not do this."""


class Unauthorized(AuthError):
    """No token, a malformed Authorization header, or an unknown token."""

    default_code = ErrorCode.UNAUTHORIZED


class Forbidden(AuthError):
    """The token is valid but lacks the scope on this run."""

    default_code = ErrorCode.FORBIDDEN


# ---- what is not there -----------------------------------------------------------------


class NotFound(BoardError):
    """Something named by the request is not there (as a code: no such route)."""

    default_code = ErrorCode.NOT_FOUND


class UnknownRun(NotFound):
    default_code = ErrorCode.UNKNOWN_RUN


class UnknownAsset(NotFound):
    default_code = ErrorCode.UNKNOWN_ASSET


class UnknownBlob(NotFound):
    default_code = ErrorCode.UNKNOWN_BLOB


class UnknownVersion(NotFound):
    """The version is not committed yet, or was pruned."""

    default_code = ErrorCode.UNKNOWN_VERSION


class UnknownBase(NotFound):
    """A plan's base version is unknown or pruned: bootstrap from a keyframe instead
    (`extra["bootstrap"]` is the plan URL to use)."""

    default_code = ErrorCode.UNKNOWN_BASE


class NoVersions(NotFound):
    """The run has no committed version yet."""

    default_code = ErrorCode.NO_VERSIONS


class NoChain(NotFound):
    """No keyframe chain reaches the version."""

    default_code = ErrorCode.NO_CHAIN


class UnknownPrepared(NotFound):
    """A commit named a prepared manifest (`POST .../prepare`) that this board does not
    hold: it expired or was evicted, the board restarted, or another replica prepared it.
    Nothing was committed; commit the manifest itself (`BoardClient.commit` does)."""

    default_code = ErrorCode.UNKNOWN_PREPARED


# ---- the board's state moved -----------------------------------------------------------


class Conflict(BoardError):
    """The board's state does not allow this now."""


class NotHead(Conflict):
    """The version does not follow the head (another commit landed): re-read the head."""

    default_code = ErrorCode.NOT_HEAD


class StaleEpoch(Conflict):
    """The writer's epoch is not the current lease's: it was fenced off."""

    default_code = ErrorCode.STALE_EPOCH


class NoLease(Conflict):
    """A commit without a lease: take one first."""

    default_code = ErrorCode.NO_LEASE


class LeaseHeld(Conflict):
    """Another holder's lease is live (`extra["holder"]`, `extra["expires_at"]`)."""

    default_code = ErrorCode.LEASE_HELD


class Contended(Conflict):
    """A record kept changing under the board's compare-and-set: retry."""

    default_code = ErrorCode.CONTENDED


# ---- the board failed ------------------------------------------------------------------


class BoardUnavailable(BoardError):
    """The board failed or is overloaded (5xx, still so after the client's retries):
    nothing is known to be wrong with the request; retry later."""

    default_code = ErrorCode.INTERNAL


class StoreUnavailable(BoardUnavailable):
    """The board cannot reach its object store (down, frozen, timing out): nothing was
    changed by this request; retry after the answer's `Retry-After`."""

    default_code = ErrorCode.STORE_UNAVAILABLE


class IndexUnavailable(BoardUnavailable):
    """The board cannot reach its shared index (Redis down or restarting): retry after
    the answer's `Retry-After`. The index is a cache of the store, rebuilt when it comes
    back, so nothing is lost; a commit the store took is answered as committed."""

    default_code = ErrorCode.INDEX_UNAVAILABLE


# ---- the answer breaks the contract ----------------------------------------------------


class InvalidResponse(BoardError):
    """The board answered with a body that does not match the contract's schema: a stored
    record it cannot read (written by an older, laxer board), or a board of an incompatible
    version. Raised by the client; retrying the same request gets the same answer."""

    default_code = ErrorCode.INVALID_RESPONSE


# ---- code -> class ---------------------------------------------------------------------

# Classes that stand for their own code.
_OWN_CODE: tuple[type[BoardError], ...] = (
    InvalidRequest,
    BodyTooLarge,
    DigestMismatch,
    BadManifest,
    MissingBlobs,
    Unauthorized,
    Forbidden,
    NotFound,
    UnknownRun,
    UnknownAsset,
    UnknownBlob,
    UnknownVersion,
    UnknownBase,
    NoVersions,
    NoChain,
    UnknownPrepared,
    NotHead,
    StaleEpoch,
    NoLease,
    LeaseHeld,
    Contended,
    BoardUnavailable,
    StoreUnavailable,
    IndexUnavailable,
    InvalidResponse,
)

# Codes that no caller tells apart: their family's class carries them.
_GROUPED: dict[ErrorCode, type[BoardError]] = {
    ErrorCode.MALFORMED_JSON: InvalidRequest,
    ErrorCode.VALIDATION_ERROR: InvalidRequest,
    ErrorCode.BAD_RUN_NAME: InvalidRequest,
    ErrorCode.BAD_ASSET_NAME: InvalidRequest,
    ErrorCode.BAD_DIGEST: InvalidRequest,
    ErrorCode.BAD_RANGE: InvalidRequest,
    ErrorCode.INCOMPLETE_BODY: InvalidRequest,
    ErrorCode.METHOD_NOT_ALLOWED: InvalidRequest,
    ErrorCode.LENGTH_REQUIRED: InvalidRequest,
    ErrorCode.RANGE_NOT_SATISFIABLE: InvalidRequest,
    ErrorCode.UNSUPPORTED_ENCODING: InvalidRequest,
    ErrorCode.HTTP_ERROR: BoardError,  # deliberately plain: nothing to act on
}

ERROR_CLASSES: dict[ErrorCode, type[BoardError]] = {
    **{cls.default_code: cls for cls in _OWN_CODE if cls.default_code is not None},
    **_GROUPED,
}


def error_class(code: str) -> type[BoardError]:
    """The class that stands for `code`; `BoardError` for a code this side does not know."""
    try:
        return ERROR_CLASSES[ErrorCode(code)]
    except ValueError:
        return BoardError
