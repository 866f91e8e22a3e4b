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

A worker keyframe is checked the same way against the chain up to its version: its state
digest is the version's, and its entries are exactly the layout's tensors, in the layout's
order (so a node's shard files are the trainer keyframe's), whole, each with the layout's
dtype, shape and file and the tensor's digest at that version.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from deltaboard.board.contract.errors import BadManifest
from deltaboard.board.contract.schemas import Manifest
from deltaboard.board.contract.spans import KeyframeManifest, SpanManifest


def span_url(run: str, from_version: int, to_version: int) -> str:
    return f"/v1/runs/{run}/spans/{from_version}/{to_version}"


def keyframe_url(run: str, version: int) -> str:
    return f"/v1/runs/{run}/keyframes/{version}"


def fold_digests(manifests: Sequence[Manifest]) -> dict[str, str]:
    """Each tensor's digest after `manifests` (a keyframe, then its deltas in order)."""
    digests: dict[str, str] = {}
    for manifest in manifests:
        digests.update((t.name, t.digest) for t in manifest.tensors)
    return digests


def _check_chain(what: str, claimed: str, run: str, chain: Sequence[Manifest], last: int) -> None:
    """Derived data `what` names `run` (`claimed`), and `chain` is one committed keyframe
    chain up to `last`."""
    if claimed != run:
        raise BadManifest(f"{what} is for run {claimed!r}, posted to {run!r}")
    if (
        not chain
        or chain[0].kind != "full"
        or [m.version for m in chain] != list(range(chain[0].version, last + 1))
    ):
        raise BadManifest(f"{what}: the versions up to {last} are not one committed keyframe chain")


def check_span(span: SpanManifest, run: str, chain: Sequence[Manifest]) -> None:
    """`chain` holds the committed manifests from a keyframe at or below the span's first
    version to its last, in order."""
    a, b = span.from_version, span.to_version
    _check_chain(f"span {a} -> {b}", span.run, run, chain, b)
    if b - a < 2:
        raise BadManifest(f"a span covers at least two versions ({a} -> {b} does not)")
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


def check_keyframe(keyframe: KeyframeManifest, run: str, chain: Sequence[Manifest]) -> None:
    """`chain` holds the committed manifests from a keyframe at or below the keyframe's
    version to it, in order."""
    v = keyframe.version
    _check_chain(f"keyframe {v}", keyframe.run, run, chain, v)
    if keyframe.state_digest != chain[-1].state_digest:
        raise BadManifest(f"keyframe {v}: the state digest is not version {v}'s")
    layout = {t.name: (t.dtype, tuple(t.shape), t.file) for t in chain[0].tensors}
    digests = fold_digests(chain)
    names = [entry.name for entry in keyframe.tensors]
    if names != list(layout):
        raise BadManifest(f"keyframe {v}: its tensors are not the layout's, in its order")
    for entry in keyframe.tensors:
        if entry.part is not None:
            raise BadManifest(
                f"keyframe {v}: tensor {entry.name!r} is a part; a keyframe holds whole tensors"
            )
        if layout[entry.name] != (entry.dtype, tuple(entry.shape), entry.file):
            raise BadManifest(f"keyframe {v}: tensor {entry.name!r} is not in the layout as given")
        if entry.digest != digests[entry.name]:
            raise BadManifest(f"keyframe {v}: tensor {entry.name!r} digest is not its digest at {v}")


SpanEnds = tuple[int | None, int]  # a span's first and last versions; None first: a keyframe


@dataclass(frozen=True)
class SpanRecord:
    """What planning and retention need of a stored span or worker keyframe: its ends
    (`from_version` None: a keyframe, a span from nothing), the sizes of the whole blobs
    it references and the stored size of its manifest."""

    from_version: int | None
    to_version: int
    blobs: dict[str, int]
    manifest_bytes: int

    @classmethod
    def of(
        cls, span: SpanManifest | KeyframeManifest, sizes: Mapping[str, int | None], manifest_bytes: int
    ) -> SpanRecord:
        blobs = {sha: sizes.get(sha) or 0 for sha in sorted(span.blob_shas())}
        if isinstance(span, KeyframeManifest):
            return cls(None, span.version, blobs, manifest_bytes)
        return cls(span.from_version, span.to_version, blobs, manifest_bytes)

    def url(self, run: str) -> str:
        """Where its manifest is read."""
        if self.from_version is None:
            return keyframe_url(run, self.to_version)
        return span_url(run, self.from_version, self.to_version)
