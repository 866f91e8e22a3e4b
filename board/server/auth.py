"""Bearer-token authorisation: scopes `read` < `compact` < `publish` < `admin` on run-name globs.

Tokens come from a config file (YAML or JSON) or from `scope:token[:glob]` strings (env or
flags). Tokens are compared in constant time against every configured token, so response
timing does not reveal how much of a guess was right. A higher scope includes the lower
ones; `read` can never publish or delete. A check that passed is remembered under the
token's sha256 (with the scope and run), since grants never change in a process: a
thousand long-pollers re-asking every second would otherwise each compare every token and
match every glob again. `compact` is the compaction worker's: it may
upload blobs and register derived data (spans, keyframes), which the board checks against
the committed manifests, but never take a lease, commit a version, create a run or write
an asset, so a leaked worker token cannot change what a run serves.
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from deltaboard.board.contract.errors import Forbidden, Unauthorized

Scope = Literal["read", "compact", "publish", "admin"]
SCOPE_RANK: dict[str, int] = {"read": 0, "compact": 1, "publish": 2, "admin": 3}


class TokenGrant(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    token: str = Field(min_length=8)
    scope: Scope
    runs: tuple[str, ...] = ("*",)
    name: str = ""


class AuthConfig(BaseModel):
    """`anonymous_read`: run globs readable without a token (empty: none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: tuple[TokenGrant, ...] = ()
    anonymous_read: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: Path) -> AuthConfig:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        if isinstance(data, dict) and isinstance(data.get("anonymous_read"), bool):
            data["anonymous_read"] = ["*"] if data["anonymous_read"] else []
        return cls.model_validate(data or {})

    @staticmethod
    def parse_grants(specs: Iterable[str]) -> tuple[TokenGrant, ...]:
        """`scope:token[:glob]` strings, e.g. `publish:s3cret:exp-*`."""
        grants = []
        for spec in specs:
            scope, _, rest = spec.strip().partition(":")
            token, _, pattern = rest.partition(":")
            grants.append(
                TokenGrant.model_validate({"scope": scope, "token": token, "runs": (pattern or "*",)})
            )
        return tuple(grants)

    def merged(self, grants: Iterable[TokenGrant], anonymous_read: bool) -> AuthConfig:
        anonymous = self.anonymous_read + (("*",) if anonymous_read else ())
        return AuthConfig(tokens=self.tokens + tuple(grants), anonymous_read=anonymous)


# Checks that passed, remembered at most; beyond, the memory starts again empty.
PASSED_CHECKS = 4096


class Authorizer:
    def __init__(self, config: AuthConfig) -> None:
        self.config = config
        self._passed: set[tuple[bytes, str, str | None]] = set()

    def _grants(self, token: str) -> list[TokenGrant]:
        presented = token.encode()
        # Compare against every token (no early exit) so timing says nothing about which matched.
        matches = [g for g in self.config.tokens if hmac.compare_digest(presented, g.token.encode())]
        return matches

    def check(self, authorization: str | None, scope: Scope, run: str | None) -> None:
        """Raise `Unauthorized` (no valid token) or `Forbidden` (not enough scope) unless the
        request may act with `scope` on `run` (None: any run)."""
        target = run or ""
        if authorization is None:
            anonymous = self.config.anonymous_read
            # Without a run (listing runs), any anonymous grant lets the caller in; the
            # listing then shows only the runs it may read.
            if (
                scope == "read"
                and anonymous
                and (run is None or any(fnmatch.fnmatchcase(target, p) for p in anonymous))
            ):
                return
            raise Unauthorized("a bearer token is required")
        kind, _, token = authorization.partition(" ")
        if kind.lower() != "bearer" or not token:
            raise Unauthorized("expected 'Authorization: Bearer <token>'")
        passed = (hashlib.sha256(token.strip().encode()).digest(), scope, run)
        if passed in self._passed:
            return
        grants = self._grants(token.strip())
        if not grants:
            raise Unauthorized("unknown token")
        for grant in grants:
            if SCOPE_RANK[grant.scope] >= SCOPE_RANK[scope] and (
                run is None or any(fnmatch.fnmatchcase(target, p) for p in grant.runs)
            ):
                if len(self._passed) >= PASSED_CHECKS:
                    self._passed.clear()
                self._passed.add(passed)
                return
        raise Forbidden(f"token lacks scope {scope!r}" + ("" if run is None else f" on run {run!r}"))
