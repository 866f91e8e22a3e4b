"""Weight-version constraints of a request and the rules that decide its fate (pure, no I/O).

A request names the versions it accepts in its JSON body,

    {"weight_version": {"exact": 7}}            # or "min", "max", "max_lag", "wait"
    {"weight_version": 7}                        # shorthand for exact

or in headers (`X-Weight-Version-Exact`, `-Min`, `-Max`, `-Max-Lag`, `-Wait`). The body
field is removed before the request reaches the engine. `max_lag` is relative to the
board's head: the version must be at least `head - max_lag`. `wait` (seconds) bounds how
long the request may wait for the node to catch up.

Outcomes, given the version the node serves and the board's head:

- `Serve`: the served version lies in `[low, high]`.
- `Wait`: the node is behind `low` (or holds nothing yet); a node only moves forward, so
  it may get there: wait up to the request's bound, then `WeightVersionNotReady`.
- `Gone`: the served version is already past `high`, or `max_lag` against the head
  leaves no version under `max`: no amount of waiting helps, the caller must re-pin
  (`WeightVersionGone`, not retryable).

The codes of the sidecar's refusals are `SidecarCode`; their HTTP statuses live in the
proxy (`services.sidecar.proxy.HTTP_STATUS`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

FIELDS = ("exact", "min", "max", "max_lag")
HEADER_PREFIX = "x-weight-version-"
BODY_KEY = "weight_version"


class SidecarCode(StrEnum):
    """Every `code` in the sidecar's own error bodies."""

    WEIGHT_VERSION_NOT_READY = "WeightVersionNotReady"  # behind the request: retry later
    WEIGHT_VERSION_GONE = "WeightVersionGone"  # past the request for good: re-pin
    ENGINE_UNAVAILABLE = "EngineUnavailable"  # the engine failed to load or cannot be reached
    ENGINE_CHANGED = "EngineChanged"  # the engine no longer holds what the sidecar loaded: retry
    BAD_WEIGHT_VERSION = "BadWeightVersion"  # a malformed constraint (`ConstraintError`)
    BODY_TOO_LARGE = "BodyTooLarge"
    NOT_FOUND = "NotFound"  # not an inference route of the engine
    METHOD_NOT_ALLOWED = "MethodNotAllowed"
    BAD_REQUEST = "BadRequest"  # not HTTP the sidecar's server can parse (`sidecar.server`)
    INTERNAL = "Internal"  # the sidecar failed before answering: a bug, not the caller's


class ConstraintError(ValueError):
    """The constraint itself is malformed or contradictory (a client mistake)."""


@dataclass(frozen=True)
class VersionConstraint:
    exact: int | None = None
    min: int | None = None
    max: int | None = None
    max_lag: int | None = None
    wait_s: float | None = None

    @property
    def empty(self) -> bool:
        return all(getattr(self, name) is None for name in FIELDS)

    def low(self, head: int | None) -> int | None:
        """The lowest acceptable version (None: any). Asked a few times per request: plain
        comparisons, no generator."""
        low = self.exact
        if self.min is not None and (low is None or self.min > low):
            low = self.min
        if head is not None and self.max_lag is not None and (low is None or head - self.max_lag > low):
            low = head - self.max_lag
        return low

    def high(self) -> int | None:
        """The highest acceptable version (None: no upper bound)."""
        if self.exact is None or (self.max is not None and self.max < self.exact):
            return self.max
        return self.exact

    def describe(self, head: int | None) -> dict[str, int | None]:
        return {"min": self.low(head), "max": self.high()}

    def words(self, head: int | None) -> str:
        """What the request accepts, for a person: "version 5", "version 5 or later"..."""
        low, high = self.low(head), self.high()
        if low is not None and low == high:
            return f"version {low}"
        if low is not None and high is not None:
            return f"a version from {low} to {high}"
        if low is not None:
            return f"version {low} or later"
        if high is not None:
            return f"version {high} or earlier"
        return "any version"


@dataclass(frozen=True)
class Serve:
    pass


@dataclass(frozen=True)
class Wait:
    low: int


@dataclass(frozen=True)
class Gone:
    reason: str


Decision = Serve | Wait | Gone


def _as_version(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConstraintError(f"weight_version.{name} must be a non-negative integer")
    try:
        number = int(value)
    except ValueError as exc:
        raise ConstraintError(f"weight_version.{name} must be a non-negative integer") from exc
    if number < 0:
        raise ConstraintError(f"weight_version.{name} must be a non-negative integer")
    return number


def _as_wait(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConstraintError("weight_version.wait must be a number of seconds")
    try:
        seconds = float(value)
    except ValueError as exc:
        raise ConstraintError("weight_version.wait must be a number of seconds") from exc
    if not math.isfinite(seconds) or seconds < 0:
        raise ConstraintError("weight_version.wait must be a finite, non-negative number of seconds")
    return seconds


def _from_mapping(raw: Mapping[str, Any]) -> VersionConstraint:
    """The constraint `raw` names; the same few constraints arrive with most requests of a
    run, so each is checked once (a field of unhashable values is checked every time)."""
    try:  # typed: 1, 1.0 and True are equal keys, not equal constraints
        return _checked(tuple(sorted((name, type(value), value) for name, value in raw.items())))
    except TypeError:
        return _check(raw)


@functools.lru_cache(maxsize=1024)
def _checked(items: tuple[tuple[str, type, Any], ...]) -> VersionConstraint:
    return _check({name: value for name, _, value in items})


def _check(raw: Mapping[str, Any]) -> VersionConstraint:
    unknown = set(raw) - {*FIELDS, "wait"}
    if unknown:
        raise ConstraintError(f"unknown weight_version fields: {sorted(unknown)}")
    values = {name: _as_version(name, raw[name]) for name in FIELDS if raw.get(name) is not None}
    wait = _as_wait(raw["wait"]) if raw.get("wait") is not None else None
    constraint = VersionConstraint(**values, wait_s=wait)
    low, high = constraint.low(None), constraint.high()
    if low is not None and high is not None and low > high:
        raise ConstraintError(f"weight_version accepts nothing: at least {low} and at most {high}")
    return constraint


_HEADERS = tuple((name, HEADER_PREFIX + name.replace("_", "-")) for name in (*FIELDS, "wait"))


def parse_constraint(body: Any, headers: Mapping[str, str]) -> tuple[VersionConstraint, Any]:
    """The request's constraint and its body without `weight_version`.

    Body fields win over headers field by field; `body` is any decoded JSON (only an
    object can carry the field).
    """
    raw: dict[str, Any] = {}
    if headers:
        for name, header_name in _HEADERS:
            header = headers.get(header_name)
            if header is not None:
                raw[name] = header.strip()
    if isinstance(body, dict) and BODY_KEY in body:
        field = body[BODY_KEY]
        body = {k: v for k, v in body.items() if k != BODY_KEY}
        if isinstance(field, dict):
            raw.update(field)
        elif field is not None:
            raw["exact"] = field
    return _from_mapping(raw), body


def decide(constraint: VersionConstraint, served: int | None, head: int | None) -> Decision:
    low, high = constraint.low(head), constraint.high()
    if low is not None and high is not None and low > high:
        return Gone(f"the board's head {head} minus max_lag {constraint.max_lag} is past max {high}")
    if served is None:
        return Wait(low if low is not None else 0)
    if high is not None and served > high:
        return Gone(f"this node serves {served}, past {high}, and never goes back")
    if low is not None and served < low:
        return Wait(low)
    return Serve()


def next_target(served: int | None, head: int | None, pins: Iterable[tuple[int, int | None]]) -> int | None:
    """The version the node should sync to next, or None when there is nothing to do.

    Normally the head; but waiting requests that accept at most some version below the
    head (`pins`: their (low, high)) make the node stop there first, so that a request
    pinned to version N is served even if N+1 was published while it waited.
    """
    if head is None:
        return None
    stops = [
        low for low, high in pins if high is not None and high < head and (served is None or low > served)
    ]
    target = min(stops, default=head)
    return None if served is not None and target <= served else target


def retry_after_s(low: int, served: int | None, head: int | None, sync_s: float, interval_s: float) -> int:
    """Seconds a refused caller should wait: a catch-up if `low` exists, plus commits to come."""
    missing = max(0, low - head) if head is not None else 1
    return max(1, math.ceil((sync_s if served is None or served < low else 0.0) + missing * interval_s))
