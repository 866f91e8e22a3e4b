"""Bearer-token scopes on run globs (board.auth)."""

from __future__ import annotations

import json

import pytest

from deltaboard.board.contract.errors import BoardError
from deltaboard.board.server.api.errors import status_of
from deltaboard.board.server.auth import PASSED_CHECKS, AuthConfig, Authorizer


def status(auth: Authorizer, header: str | None, scope: str, run: str | None) -> int:
    try:
        auth.check(header, scope, run)  # type: ignore[arg-type]
    except BoardError as e:
        return status_of(e)
    return 200


def test_scopes_and_patterns():
    grants = AuthConfig.parse_grants(["read:reader-token", "publish:pub-token-x:exp-*", "admin:admin-token"])
    auth = Authorizer(AuthConfig(tokens=grants))
    r, p, a = "Bearer reader-token", "Bearer pub-token-x", "Bearer admin-token"
    assert status(auth, r, "read", "anything") == 200
    assert status(auth, r, "publish", "anything") == 403
    assert status(auth, r, "admin", "anything") == 403
    assert status(auth, p, "publish", "exp-1") == 200
    assert status(auth, p, "read", "exp-1") == 200
    assert status(auth, p, "publish", "prod") == 403
    assert status(auth, p, "admin", "exp-1") == 403
    assert status(auth, a, "admin", "x") == 200
    assert status(auth, None, "read", "x") == 401
    assert status(auth, "Bearer nope-nope", "read", "x") == 401
    assert status(auth, "Token reader-token", "read", "x") == 401


def test_a_passed_check_is_remembered_for_its_token_scope_and_run_only():
    grants = AuthConfig.parse_grants(["read:reader-token:exp-*", "publish:pub-token-x:exp-*"])
    auth = Authorizer(AuthConfig(tokens=grants))
    r = "Bearer reader-token"
    for _ in range(2):  # the second round answers from what the first remembered
        assert status(auth, r, "read", "exp-1") == 200
        assert status(auth, r, "publish", "exp-1") == 403
        assert status(auth, r, "read", "prod") == 403
        assert status(auth, "Bearer reader-tokeX", "read", "exp-1") == 401
        assert status(auth, "Bearer pub-token-x", "read", "exp-1") == 200
    for i in range(PASSED_CHECKS + 10):
        assert status(auth, r, "read", f"exp-{i}") == 200
    assert len(auth._passed) <= PASSED_CHECKS


def test_compact_lies_between_read_and_publish():
    """The compaction worker's scope: enough to register derived data, not to publish."""
    grants = AuthConfig.parse_grants(["compact:compact-token", "read:reader-token", "publish:pub-token-x"])
    auth = Authorizer(AuthConfig(tokens=grants))
    c, r, p = "Bearer compact-token", "Bearer reader-token", "Bearer pub-token-x"
    assert status(auth, c, "compact", "x") == 200
    assert status(auth, c, "read", "x") == 200
    assert status(auth, c, "publish", "x") == 403
    assert status(auth, r, "compact", "x") == 403
    assert status(auth, p, "compact", "x") == 200


def test_anonymous_read_only_when_configured(tmp_path):
    path = tmp_path / "auth.yaml"
    path.write_text("anonymous_read: true\ntokens:\n  - {token: pub-token-y, scope: publish, runs: ['a*']}\n")
    auth = Authorizer(AuthConfig.load(path))
    assert status(auth, None, "read", "x") == 200
    assert status(auth, None, "publish", "x") == 401
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"anonymous_read": ["public-*"]}))
    auth = Authorizer(
        AuthConfig.load(path).merged(AuthConfig.parse_grants(["read:abcdefgh"]), anonymous_read=False)
    )
    assert status(auth, None, "read", "public-1") == 200
    assert status(auth, None, "read", "private") == 401
    assert status(auth, None, "read", None) == 200  # listing: filtered to public-* by the route
    assert status(auth, "Bearer abcdefgh", "read", "private") == 200


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError):
        AuthConfig.parse_grants(["superuser:abcdefgh"])
    with pytest.raises(ValueError):
        AuthConfig.parse_grants(["read:short"])
    path = tmp_path / "auth.yaml"
    path.write_text("tokens: [{token: abcdefgh, scope: read, unknown: 1}]\n")
    with pytest.raises(ValueError):
        AuthConfig.load(path)
