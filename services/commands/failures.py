"""One line for every mistake a user can make; a traceback only when asked for.

Every command runs under `deltaboard.services.cli.main`, which hands an exception that
escapes a command to `explain`. The project's typed errors (the board's vocabulary, the
follower's and the codec's errors), connection failures, invalid settings and refusals
of the file system are a user's mistake or a fact of the environment: they become one
red line and exit status 1, because the reader needs what went wrong and what to do, not
the stack of the code that found it. Anything else is a bug of ours and keeps its
traceback. `deltaboard --debug` (or DELTABOARD_DEBUG=1) shows the traceback of every
failure.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx

    from deltaboard.board.contract.errors import BoardError

DEBUG_ENV = "DELTABOARD_DEBUG"


class UserError(Exception):
    """A mistake in the command line or its environment, said in one line."""


def debugging() -> bool:
    """Whether failures show their traceback (`--debug` sets the variable for children too)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def explain(exc: BaseException) -> str | None:
    """The one line that says what went wrong and what to do, or None for a bug."""
    import httpx
    from pydantic import ValidationError

    from deltaboard.board.contract.errors import BoardError

    if isinstance(exc, BoardError):
        return _board(exc)
    if isinstance(exc, httpx.TransportError):
        return _transport(exc)
    if isinstance(exc, ValidationError):
        problems = "; ".join(f"{_where(e['loc'])}{e['msg']}" for e in exc.errors(include_url=False))
        return f"invalid {exc.title}: {problems}"
    if isinstance(exc, UserError) or _is(exc, "deltaboard.clients.follower.errors", "FollowerError"):
        return str(exc)
    if _is(exc, "deltaboard.board.codec.errors", "PatchError"):
        return f"a patch does not apply: {exc}"
    if isinstance(exc, OSError):
        return f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
    return None


def _is(exc: BaseException, module: str, name: str) -> bool:
    """`isinstance(exc, module.name)` without importing `module`: an exception can only be
    an instance of a class whose module is loaded, and importing the follower or the codec
    just to find out costs seconds (the codec loads its compiled loops)."""
    loaded = sys.modules.get(module)
    cls = getattr(loaded, name, None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _board(exc: BoardError) -> str:
    from deltaboard.board.contract.errors import BoardUnavailable, Forbidden, Unauthorized

    if isinstance(exc, Unauthorized):
        return f"the board refused the token ({exc.message}): pass one with --token or DELTABOARD_TOKEN"
    if isinstance(exc, Forbidden):
        return f"the token may not do this ({exc.message}): scopes are read < publish < admin"
    if isinstance(exc, BoardUnavailable):
        return f"the board failed ({exc.code}: {exc.message}); try again later"
    return f"{exc.code}: {exc.message}"


def _transport(exc: httpx.TransportError) -> str:
    import httpx

    try:
        url = exc.request.url
        where = f"{url.scheme}://{url.netloc.decode()}"
    except RuntimeError:  # an error raised before a request was attached
        where = "the board"
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return f"cannot reach {where} ({reason}): is the board running? (--board or DELTABOARD_URL)"
    if isinstance(exc, httpx.TimeoutException):
        return f"{where} did not answer in time ({reason})"
    return f"the connection to {where} failed ({reason})"


def _where(loc: tuple[int | str, ...]) -> str:
    return ".".join(map(str, loc)) + ": " if loc else ""
