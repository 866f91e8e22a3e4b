"""Pure planning: the cheapest chain of versions that takes a node from `a` to `b`.

A node either replays the deltas after the version it holds, or starts over from a
keyframe at or below `b` and replays the deltas after it. A chain costs its blobs, each
counted once because a node downloads each blob once, plus one manifest per step (small
deltas cost as much in manifest as in blobs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from deltaboard.board.contract.errors import NoChain, NoVersions, UnknownBase, UnknownVersion
from deltaboard.board.contract.schemas import BlobSize, Plan, PlanStep
from deltaboard.board.server.records import VersionRecord


def manifest_url(run: str, version: int) -> str:
    return f"/v1/runs/{run}/manifests/{version}"


def _blob_bytes(chain: Iterable[VersionRecord]) -> int:
    sizes: dict[str, int] = {}
    for record in chain:
        sizes.update(record.blobs)
    return sum(sizes.values())


def _chain_bytes(chain: list[VersionRecord]) -> int:
    """What the chain costs to download: its blobs and its manifests."""
    return _blob_bytes(chain) + sum(r.manifest_bytes for r in chain)


def _chain(versions: Mapping[int, VersionRecord], first: int, last: int) -> list[VersionRecord] | None:
    """Versions first..last, or None when one of them is gone."""
    chain = [versions.get(v) for v in range(first, last + 1)]
    return None if any(r is None for r in chain) else [r for r in chain if r is not None]


def _bootstrap_hint(run: str, to: int) -> str:
    return f"/v1/runs/{run}/plan?to={to}"


def plan(
    run: str,
    versions: Mapping[int, VersionRecord],
    head: int | None,
    from_version: int | None,
    to_version: int | None,
) -> Plan:
    """The plan from `from_version` (None: bootstrap) to `to_version` (None: head)."""
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

    candidates: list[tuple[int, str, list[VersionRecord]]] = []
    if from_version is not None and from_version < to:
        deltas = _chain(versions, from_version + 1, to)
        if deltas is not None:
            candidates.append((_chain_bytes(deltas), "deltas", deltas))
    for k, record in versions.items():
        if record.kind == "full" and k <= to:
            chain = _chain(versions, k, to)
            if chain is not None:
                candidates.append((_chain_bytes(chain), "keyframe+deltas", chain))
    if not candidates:
        raise NoChain(f"no keyframe chain reaches version {to}")
    # Fewest bytes; on a tie, fewer steps (less work to apply), then the plain delta chain.
    _, strategy, chain = min(candidates, key=lambda c: (c[0], len(c[2]), c[1] != "deltas"))
    steps = tuple(
        PlanStep(
            version=r.version,
            kind=r.kind,
            manifest_url=manifest_url(run, r.version),
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
        strategy="deltas" if strategy == "deltas" else "keyframe+deltas",
    )
