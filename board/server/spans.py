"""Pure rules of a span registration (no I/O): a span must say exactly what the committed
manifests say about its two ends.

The board folds the manifests from the keyframe at or below the span's first version up
to its last (a delta lists only the tensors it changed; the latest entry of a tensor is
its digest) into each tensor's digest at both ends, then refuses (`BadManifest`) a span
unless: its ends are committed, at least two versions apart and in one keyframe chain;
its state digests are the two manifests'; each entry is a whole tensor (no part) with
the layout's dtype, shape and file, its `base_digest` is the tensor's digest at the first
version and its `digest` the one at the last; and every tensor that differs between the
ends has an entry, so that the base's digests updated by the entries are the last
version's. Runs published in parts get no spans from the worker yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.spans import SpanManifest


def span_url(run: str, from_version: int, to_version: int) -> str:
    return f"/v1/runs/{run}/spans/{from_version}/{to_version}"


def fold_digests(manifests: Sequence[Manifest]) -> dict[str, str]:
    """Each tensor's digest after `manifests` (a keyframe, then its deltas in order)."""
    digests: dict[str, str] = {}
    for manifest in manifests:
        digests.update((t.name, t.digest) for t in manifest.tensors)
    return digests


def check_span(span: SpanManifest, run: str, chain: Sequence[Manifest]) -> None:
    """`chain` holds the committed manifests from a keyframe at or below the span's first
    version to its last, in order."""
    a, b = span.from_version, span.to_version
    if span.run != run:
        raise BadManifest(f"span is for run {span.run!r}, posted to {run!r}")
    if b - a < 2:
        raise BadManifest(f"a span covers at least two versions ({a} -> {b} does not)")
    if (
        not chain
        or chain[0].kind != "full"
        or [m.version for m in chain] != list(range(chain[0].version, b + 1))
    ):
        raise BadManifest(f"versions {a}..{b} are not one committed keyframe chain")
    first = a - chain[0].version
    if any(m.kind == "full" for m in chain[first + 1 :]):
        raise BadManifest(f"a keyframe lies inside span {a} -> {b}: bootstrap from it instead")
    if span.base_state_digest != chain[first].state_digest or span.state_digest != chain[-1].state_digest:
        raise BadManifest(f"span {a} -> {b}: state digests are not those of versions {a} and {b}")
    layout = {t.name: (t.dtype, tuple(t.shape), t.file) for t in chain[0].tensors}
    before, after = fold_digests(chain[: first + 1]), fold_digests(chain)
    seen = set()
    for entry in span.tensors:
        if entry.name in seen:
            raise BadManifest(f"span {a} -> {b}: tensor {entry.name!r} appears twice")
        seen.add(entry.name)
        if entry.part is not None:
            raise BadManifest(
                f"span {a} -> {b}: tensor {entry.name!r} is a part; a span patches whole tensors"
            )
        if layout.get(entry.name) != (entry.dtype, tuple(entry.shape), entry.file):
            raise BadManifest(f"span {a} -> {b}: tensor {entry.name!r} is not in the layout as given")
        if entry.base_digest != before[entry.name] or entry.digest != after[entry.name]:
            raise BadManifest(
                f"span {a} -> {b}: tensor {entry.name!r} digests are not its digests at {a} and {b}"
            )
    missing = sorted(name for name in after if before.get(name) != after[name] and name not in seen)
    if missing:
        raise BadManifest(f"span {a} -> {b} leaves out {len(missing)} changed tensors", missing=missing[:16])


@dataclass(frozen=True)
class SpanRecord:
    """What planning and retention need of a stored span: its ends, the sizes of the whole
    blobs it references and the stored size of its manifest."""

    from_version: int
    to_version: int
    blobs: dict[str, int]
    manifest_bytes: int

    @classmethod
    def of(cls, span: SpanManifest, sizes: Mapping[str, int | None], manifest_bytes: int) -> SpanRecord:
        blobs = {sha: sizes.get(sha) or 0 for sha in sorted(span.blob_shas())}
        return cls(span.from_version, span.to_version, blobs, manifest_bytes)
