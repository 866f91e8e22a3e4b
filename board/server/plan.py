"""Pure planning: the cheapest chain of versions that takes a node from `a` to `b`.

A node either moves on from the version it holds, or starts over from a keyframe at or
below `b` (the trainer's, or one the compaction worker registered), then moves by deltas
(one version) and spans (several, `board.server.spans`) to `b`. A chain costs its blobs,
each counted once because a node downloads each blob once, plus one manifest per step
(small deltas cost as much in manifest as in blobs); the cheapest by bytes wins, then the
one with fewer steps (less work to apply).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal

from deltaboard.board.contract.errors import NoChain, NoVersions, UnknownBase, UnknownVersion
from deltaboard.board.contract.schemas import BlobSize, Plan, PlanStep
from deltaboard.board.server.records import VersionRecord
from deltaboard.board.server.spans import SpanEnds, SpanRecord

Step = VersionRecord | SpanRecord
_NEVER = 2**63


def manifest_url(run: str, version: int) -> str:
    return f"/v1/runs/{run}/manifests/{version}"


def _blob_bytes(chain: Iterable[Step]) -> int:
    sizes: dict[str, int] = {}
    for step in chain:
        sizes.update(step.blobs)
    return sum(sizes.values())


def _step_bytes(step: Step) -> int:
    return sum(step.blobs.values()) + step.manifest_bytes


def _step_url(run: str, step: Step) -> str:
    if isinstance(step, SpanRecord):
        return step.url(run)
    return manifest_url(run, step.version)


def _kind(step: Step) -> Literal["full", "delta", "span", "keyframe"]:
    if isinstance(step, SpanRecord):
        return "keyframe" if step.from_version is None else "span"
    return step.kind


def _strategy(chain: list[Step]) -> Literal["deltas", "keyframe+deltas", "spans", "keyframe+spans"]:
    keyframe = _kind(chain[0]) in ("full", "keyframe")
    if any(_kind(step) == "span" for step in chain):
        return "keyframe+spans" if keyframe else "spans"
    return "keyframe+deltas" if keyframe else "deltas"


def cheapest(
    versions: Mapping[int, VersionRecord],
    spans: Mapping[SpanEnds, SpanRecord],
    from_version: int | None,
    to: int,
) -> list[Step] | None:
    """The cheapest chain to `to`, by (bytes, steps): a shortest path over the versions,
    starting at `from_version` (free) or at any keyframe at or below `to` (its bytes; the
    trainer's or a worker's: a span from nothing),
    moving by a delta (v - 1 -> v) or by a span (a -> b). A step's bytes are its own blobs
    and manifest (blobs shared between steps are rare; the plan's totals count them once)."""
    best: dict[int, tuple[int, int]] = {}
    came: dict[int, tuple[int | None, Step]] = {}
    if from_version is not None and from_version < to:
        best[from_version] = (0, 0)
    starts: list[tuple[int, Step]] = [(k, r) for k, r in versions.items() if r.kind == "full"]
    starts += [(s.to_version, s) for s in spans.values() if s.from_version is None]
    for k, record in starts:
        if k <= to and (_step_bytes(record), 1) < best.get(k, (_NEVER, 0)):
            best[k], came[k] = (_step_bytes(record), 1), (None, record)
    arriving: dict[int, list[tuple[int, Step]]] = {}
    for span in spans.values():
        if span.from_version is not None and span.to_version <= to:
            arriving.setdefault(span.to_version, []).append((span.from_version, span))
    for v in range(min(best, default=to + 1) + 1, to + 1):
        options = list(arriving.get(v, ()))
        delta = versions.get(v)
        if delta is not None and delta.kind == "delta":
            options.append((v - 1, delta))
        for base, step in options:
            if base in best:
                cost = (best[base][0] + _step_bytes(step), best[base][1] + 1)
                if cost < best.get(v, (_NEVER, 0)):
                    best[v], came[v] = cost, (base, step)
    if to not in best:
        return None
    chain: list[Step] = []
    at: int | None = to
    while at is not None and at in came:
        at, step = came[at]
        chain.append(step)
    return chain[::-1]


def _bootstrap_hint(run: str, to: int) -> str:
    return f"/v1/runs/{run}/plan?to={to}"


def plan(
    run: str,
    versions: Mapping[int, VersionRecord],
    head: int | None,
    from_version: int | None,
    to_version: int | None,
    spans: Mapping[SpanEnds, SpanRecord] | None = None,
) -> Plan:
    """The plan from `from_version` (None: bootstrap) to `to_version` (None: head), using
    the `spans` stored where they are cheaper than the deltas they cover."""
    if head is None:
        raise NoVersions(f"run {run!r} has no committed version yet")
    to = head if to_version is None else to_version
    if to > head or to not in versions:
        raise UnknownVersion(f"version {to} is not available (head {head})", head=head)
    if from_version == to:
        return Plan(
            run=run, from_version=from_version, to_version=to, steps=(), total_bytes=0, strategy="noop"
        )
    if from_version is not None and from_version not in versions:
        raise UnknownBase(
            f"version {from_version} is unknown or pruned; bootstrap from a keyframe instead",
            bootstrap=_bootstrap_hint(run, to),
        )

    chain = cheapest(versions, spans or {}, from_version, to)
    if chain is None:
        raise NoChain(f"no keyframe chain reaches version {to}")
    steps = tuple(
        PlanStep(
            version=r.to_version if isinstance(r, SpanRecord) else r.version,
            kind=_kind(r),
            manifest_url=_step_url(run, r),
            blobs=tuple(BlobSize(sha256=sha, size=size) for sha, size in r.blobs.items()),
            manifest_bytes=r.manifest_bytes,
        )
        for r in chain
    )
    return Plan(
        run=run,
        from_version=from_version,
        to_version=to,
        steps=steps,
        total_bytes=_blob_bytes(chain),
        manifest_bytes=sum(r.manifest_bytes for r in chain),
        strategy=_strategy(chain),
    )
