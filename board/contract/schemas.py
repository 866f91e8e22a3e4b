"""Wire schemas of the board contract (pydantic).

Everything that crosses a process boundary (manifests in the object store, HTTP bodies
between publisher, board and followers) is one of these models. They are the contract:
change them only together with docs/contract.md.

Numbers are strict: a boolean is not a number (`"version": false` is refused, not read as
0), and floats are finite everywhere, in free-form `meta` too: JSON has no NaN or
infinity, so a non-finite value could only be stored as `null` and break every reader of
the record afterwards. Free-form strings must be encodable as UTF-8 (no lone surrogates),
for the same reason.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal, overload

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    StrictInt,
    field_serializer,
    model_validator,
)
from pydantic_core import core_schema

ManifestFormat = Literal["deltaboard/manifest/v1", "deltaboard/manifest/v2"]
MANIFEST_V1: Literal["deltaboard/manifest/v1"] = "deltaboard/manifest/v1"
MANIFEST_FORMAT: Literal["deltaboard/manifest/v2"] = "deltaboard/manifest/v2"

# Names that end up in object-store keys and file paths: no traversal, no separators.
# Check them with `fullmatch` (`$` alone also matches before a trailing newline); the
# patterns keep their anchors for JSON Schema, where `$` is the end of the text.
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# The codec's tensor digest (`board.codec.digest`): two 64-bit lanes in hex.
DIGEST_RE = re.compile(r"^[0-9a-f]{32}$")
# Asset names may live in one sub-folder level (e.g. "tokenizer/vocab.json") but never climb out.
ASSET_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$")


def _not_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


def _json_object(value: dict[str, Any]) -> dict[str, Any]:
    """Refuse what JSON cannot carry back: non-finite floats and unencodable strings."""
    pending: list[tuple[str, Any]] = [("", value)]
    while pending:
        where, item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{where} is {item}: numbers must be finite")
        if isinstance(item, str):
            _encodable(item, where)
        elif isinstance(item, dict):
            for key, inner in item.items():
                inside = f"{where}.{key}" if where else str(key)
                _encodable(str(key), inside)
                pending.append((inside, inner))
        elif isinstance(item, list | tuple):
            pending.extend((f"{where}[{i}]", inner) for i, inner in enumerate(item))
    return value


def _encodable(text: str, where: str) -> None:
    try:
        text.encode()
    except UnicodeEncodeError:
        shown = where.encode("utf-8", "backslashreplace").decode()  # the message must encode
        raise ValueError(f"{shown} is not valid UTF-8 (a lone surrogate?)") from None


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]  # finite: `Strict` sets allow_inf_nan=False
NonNegative = Annotated[Int, Field(ge=0)]
# Free-form metadata: any JSON object, with finite numbers and encodable strings.
Meta = Annotated[dict[str, Any], AfterValidator(_json_object)]

# Versions are positive and bounded so that nobody can ask the board to walk 2**63 keys.
MAX_VERSION = 10**12
Version = Annotated[Int, Field(ge=0, le=MAX_VERSION)]
Sha256 = Annotated[str, Field(pattern=SHA256_RE.pattern)]
Digest = Annotated[str, Field(pattern=DIGEST_RE.pattern)]
RunName = Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]


class Strict(BaseModel):
    """Base: unknown fields are a client mistake, not something to drop silently; floats
    are finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ViewRule(Strict):
    """Serve tensors whose name matches `pattern` (fnmatch glob) in `dtype`.

    `fp8_e4m3_block128` serves a 2-D floating weight as float8_e4m3fn with an fp32
    `<name>_scale_inv` per 128x128 block (Hugging Face's fine-grained FP8 layout), its
    scales by `scale`: `amax` / 448, or that rounded up to a power of two (`ue8m0`); the
    bits are `deltaboard.publisher.quantize`'s. Tensors of other ranks go on to the next
    rule. `scale` means nothing to the other dtypes.
    """

    pattern: str
    dtype: Literal["bf16", "fp16", "fp32", "raw", "fp8_e4m3_block128"]
    scale: Literal["amax", "ue8m0"] = "amax"


class ViewSpec(Strict):
    """How the trainer's parameters become the bytes the engine serves.

    Floating tensors are cast to `default_dtype` unless a rule (first match wins) says
    otherwise; integer and fp8 tensors always pass through as raw bytes. Shards are cut at
    `shard_max_bytes` in state-dict order, like Hugging Face's `save_pretrained`.
    """

    default_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    rules: tuple[ViewRule, ...] = ()
    shard_max_bytes: Int = Field(default=5 * 2**30, gt=0)


class BlobRef(Strict):
    """A byte range of a content-addressed blob: many small tensor patches share one blob."""

    sha256: Sha256
    offset: NonNegative
    length: NonNegative


class TensorPart(Strict):
    """The slice of a tensor that one entry carries (docs/contract.md, "Parts"): the box of
    elements at `offset` of `shape` (one index range per dimension of the tensor), whose
    elements, row-major over the box, are the entry's patch. `digest` is the codec's digest
    of those elements at their positions in the whole tensor (`codec.digest_slice`)."""

    offset: tuple[NonNegative, ...]
    shape: tuple[NonNegative, ...]
    digest: Digest


class TensorEntry(Strict):
    """One tensor of a version, or one part of it.

    `dtype` is the safetensors dtype name of the served bytes (BF16, F16, F32, F8_E4M3,
    I64, ...). `file` is the shard file the tensor lives in. `blob` holds the codec's
    patch (kind delta) or keyframe encoding (kind full); the codec's header says which.
    `digest` is the codec's digest of the tensor bytes this entry produces (with `part`:
    of the whole tensor, after every part of this version). `part` (absent: the whole
    tensor) names the slice the blob patches; a tensor published in parts has one entry per
    part. What a board checks beyond the form (known dtype, sane shape, shard file name,
    parts that do not overlap, ...) is in `board.contract.manifest_rules`.
    """

    name: str = Field(min_length=1, max_length=512)
    dtype: str = Field(max_length=32)
    shape: tuple[Int, ...]
    file: str = Field(max_length=128)
    blob: BlobRef
    digest: Digest
    changed: NonNegative
    # left out of the JSON when absent, so a whole tensor's entry reads as it always did
    part: TensorPart | None = Field(default=None, exclude_if=lambda part: part is None)


NonNegativeStrict = Annotated[StrictInt, Field(ge=0)]


class TensorColumns(Strict):
    """A format-v2 manifest's tensor entries on the wire, one column per `TensorEntry`
    field: entry i is row i of every column. A blob's sha256 is stated once in `blobs`,
    and `blob[i]` is its index there (the range `offset[i]`, `length[i]`); `part` is left
    out when no entry has one. Each column is validated in pydantic's core as a whole, so
    a manifest of 20,000 tensors costs no Python object per entry to validate (v1's list
    of entries costs two models each: the commit of a many-tensor model was dominated by
    them). Numbers are strict ints (a boolean is not a number, as everywhere)."""

    blobs: tuple[Sha256, ...]
    name: tuple[Annotated[str, Field(min_length=1, max_length=512)], ...]
    dtype: tuple[Annotated[str, Field(max_length=32)], ...]
    shape: tuple[tuple[StrictInt, ...], ...]
    file: tuple[Annotated[str, Field(max_length=128)], ...]
    blob: tuple[NonNegativeStrict, ...]
    offset: tuple[NonNegativeStrict, ...]
    length: tuple[NonNegativeStrict, ...]
    digest: tuple[Digest, ...]
    changed: tuple[NonNegativeStrict, ...]
    part: tuple[TensorPart | None, ...] | None = Field(default=None, exclude_if=lambda part: part is None)

    @model_validator(mode="after")
    def _rows(self) -> TensorColumns:
        """Columns of one length; every blob index names a blob, every blob is named once
        and used (so `blobs` is exactly the manifest's blobs)."""
        rows = len(self.name)
        for field in ("dtype", "shape", "file", "blob", "offset", "length", "digest", "changed", "part"):
            column = getattr(self, field)
            if column is not None and len(column) != rows:
                raise ValueError(f"tensors.{field} has {len(column)} rows, tensors.name {rows}")
        if len(set(self.blobs)) != len(self.blobs):
            raise ValueError("tensors.blobs names a blob twice")
        if set(self.blob) != set(range(len(self.blobs))):
            raise ValueError(f"tensors.blob must use each of the {len(self.blobs)} blobs, and only those")
        return self

    @classmethod
    def of(cls, entries: Sequence[TensorEntry]) -> TensorColumns:
        """The columns of entries that are already valid (no validation again)."""
        index: dict[str, int] = {}
        blob = [index.setdefault(e.blob.sha256, len(index)) for e in entries]
        parts = tuple(e.part for e in entries)
        return cls.model_construct(
            blobs=tuple(index),
            name=tuple(e.name for e in entries),
            dtype=tuple(e.dtype for e in entries),
            shape=tuple(e.shape for e in entries),
            file=tuple(e.file for e in entries),
            blob=tuple(blob),
            offset=tuple(e.blob.offset for e in entries),
            length=tuple(e.blob.length for e in entries),
            digest=tuple(e.digest for e in entries),
            changed=tuple(e.changed for e in entries),
            part=parts if any(p is not None for p in parts) else None,
        )


# every field given (a constructed model then skips working out which were)
_ENTRY_FIELDS = set(TensorEntry.model_fields)
_BLOB_FIELDS = set(BlobRef.model_fields)


class TensorTable(Sequence[TensorEntry]):
    """A manifest's tensor entries: a sequence of `TensorEntry` held as `TensorColumns`.

    It reads either form (v1's list of entries, v2's columns) and keeps the columns, which
    is what the board's rules and the publisher use; the entries themselves are built on
    first use (a follower applying the manifest), never to validate or store it. A model
    copy that sets `tensors` to a plain tuple of entries (`model_copy(update=...)`) stays
    valid: `TensorTable.of` takes either. (It is the schema of `Manifest.tensors`, typed as
    the sequence of entries it is.)"""

    __slots__ = ("_entries", "columns")

    def __init__(self, columns: TensorColumns, entries: tuple[TensorEntry, ...] | None = None) -> None:
        self.columns = columns
        self._entries = entries

    @classmethod
    def of(cls, entries: Sequence[TensorEntry]) -> TensorTable:
        if isinstance(entries, TensorTable):
            return entries
        rows = tuple(entries)
        return cls(TensorColumns.of(rows), rows)

    def entries(self) -> tuple[TensorEntry, ...]:
        if self._entries is None:
            c = self.columns
            parts = c.part or (None,) * len(c.name)
            self._entries = tuple(
                TensorEntry.model_construct(
                    _ENTRY_FIELDS,
                    name=name,
                    dtype=dtype,
                    shape=shape,
                    file=file,
                    blob=BlobRef.model_construct(
                        _BLOB_FIELDS, sha256=c.blobs[blob], offset=offset, length=length
                    ),
                    digest=digest,
                    changed=changed,
                    part=part,
                )
                for name, dtype, shape, file, blob, offset, length, digest, changed, part in zip(
                    c.name,
                    c.dtype,
                    c.shape,
                    c.file,
                    c.blob,
                    c.offset,
                    c.length,
                    c.digest,
                    c.changed,
                    parts,
                    strict=True,
                )
            )
        return self._entries

    def blob_shas(self) -> set[str]:
        return set(self.columns.blobs)

    def __len__(self) -> int:
        return len(self.columns.name)

    @overload
    def __getitem__(self, index: int) -> TensorEntry: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[TensorEntry, ...]: ...
    def __getitem__(self, index: int | slice) -> TensorEntry | tuple[TensorEntry, ...]:
        return self.entries()[index]

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return self.columns == other.columns
        if isinstance(other, tuple):
            return self.entries() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.columns)

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} entries)"

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        """Entries as v1's list (validated one model each, as before) or v2's columns;
        serialized by the manifest, whose `format` says which form. A union, so that JSON
        is validated as it is parsed (a function around it would first turn a v1 list into
        Python objects: twice the time to read a stored v1 manifest)."""
        entries = handler.generate_schema(tuple[TensorEntry, ...])
        columns = handler.generate_schema(TensorColumns)
        # labelled, so that an error reads `tensors.entries.3.dtype` / `tensors.columns.dtype.3`
        forms: list[core_schema.CoreSchema | tuple[core_schema.CoreSchema, str]] = [
            (core_schema.no_info_after_validator_function(cls, columns), "columns"),
            (core_schema.no_info_after_validator_function(cls.of, entries), "entries"),
        ]
        # In order, the first form that validates wins: an object can only be columns and an
        # array only entries. (pydantic's default "smart" union validates the columns twice,
        # strict then lax, to rank the forms: 33-36 against 17-22 ms for a 20,000-entry
        # manifest on the dev machine.)
        return core_schema.json_or_python_schema(
            json_schema=core_schema.union_schema(forms, mode="left_to_right"),
            python_schema=core_schema.union_schema(
                [core_schema.is_instance_schema(cls), *forms], mode="left_to_right"
            ),
        )


class ManifestStats(Strict):
    changed_elements: NonNegative
    total_elements: NonNegative
    encoded_bytes: NonNegative
    view_bytes: NonNegative


class Manifest(Strict):
    """An immutable version. A delta lists only the tensors that changed; the layout
    (every tensor's file, dtype, shape, order) is the one of the nearest keyframe.

    `format` says how `tensors` is written: v2 (what publishers write) as `TensorColumns`,
    v1 (older publishers, and the manifests they stored) as a list of entries. Either form
    is read whatever the format, and written as the format says, so a v1 manifest is
    stored and served as v1."""

    format: ManifestFormat = MANIFEST_FORMAT
    run: RunName
    version: Version
    parent: Version | None
    kind: Literal["full", "delta"]
    view: ViewSpec
    epoch: NonNegative
    created_at: Float
    meta: Meta = Field(default_factory=dict)
    tensors: Annotated[Sequence[TensorEntry], TensorTable]
    state_digest: Sha256
    stats: ManifestStats

    def blob_shas(self) -> set[str]:
        return TensorTable.of(self.tensors).blob_shas()

    @field_serializer("tensors")
    def _tensors_form(self, tensors: Sequence[TensorEntry]) -> Any:
        """Columns for v2, a list of entries for v1 (each serialized by its own model)."""
        table = TensorTable.of(tensors)
        return table.entries() if self.format == MANIFEST_V1 else table.columns


# ---- HTTP bodies -------------------------------------------------------------------


class RunCreate(Strict):
    name: RunName
    meta: Meta = Field(default_factory=dict)


class RunInfo(Strict):
    name: RunName
    created_at: Float
    meta: Meta
    head: Version | None
    assets: tuple[str, ...]


class LeaseRequest(Strict):
    """`steal`: take the lease even while another holder's is live (a replacement trainer)."""

    holder: str = Field(min_length=1, max_length=256)
    ttl_s: Float = Field(default=60.0, gt=0, le=3600)
    steal: bool = False


class LeaseRenew(Strict):
    holder: str = Field(min_length=1, max_length=256)
    epoch: NonNegative
    ttl_s: Float = Field(default=60.0, gt=0, le=3600)


class Lease(Strict):
    run: RunName
    holder: str
    epoch: Int
    expires_at: Float


class BlobUploadTarget(Strict):
    """Where to PUT a blob. `exists` means the board already holds it (dedup): skip."""

    sha256: Sha256
    exists: bool
    url: str | None
    method: Literal["PUT"] = "PUT"
    headers: dict[str, str] = Field(default_factory=dict)


class PrepareRequest(Strict):
    manifest: Manifest


class Prepared(Strict):
    """A manifest the board checked and holds, ready to commit by name (`prepared`) for
    `expires_in_s` seconds: the sha256 of the JSON it will store."""

    run: RunName
    version: Version
    prepared: Sha256
    expires_in_s: Float


class CommitRequest(Strict):
    """The manifest itself, or the name of one this board prepared (`Prepared.prepared`):
    exactly one of them."""

    manifest: Manifest | None = None
    prepared: Sha256 | None = None

    @model_validator(mode="after")
    def _one(self) -> CommitRequest:
        if (self.manifest is None) == (self.prepared is None):
            raise ValueError("give the manifest or the name of a prepared one, not both or neither")
        return self

    @property
    def committed(self) -> Manifest | str:
        """The manifest, or the prepared one's name."""
        return self.manifest if self.manifest is not None else str(self.prepared)


class Head(Strict):
    run: RunName
    version: Version | None
    kind: Literal["full", "delta"] | None = None
    epoch: Int | None = None


class VersionSummary(Strict):
    """One committed version as the operators' dashboard charts it (`GET .../versions`):
    the bytes a node downloads for it (its whole blobs and its manifest), the fraction of
    the view's elements it changed, when the publisher made it and how long the board took
    to commit it (None when this board did not take the commit itself)."""

    version: Version
    kind: Literal["full", "delta"]
    bytes: NonNegative
    changed_fraction: Float = Field(ge=0, le=1)
    created_at: Float
    commit_s: Float | None


class BlobSize(Strict):
    """A stored blob (also the answer to a blob upload through the board)."""

    sha256: Sha256
    size: NonNegative


class StoredAsset(Strict):
    """The answer to an asset upload."""

    name: str
    size: NonNegative
    sha256: Sha256


class PlanStep(Strict):
    """`manifest_bytes`: the stored (uncompressed) size of the step's manifest. A `span`
    step reaches `version` from the previous step's (its manifest is a
    `board.contract.spans.SpanManifest`); it is applied like a delta. A `keyframe` step
    (always first) is a worker keyframe of `version` (`board.contract.spans.
    KeyframeManifest`), applied like the trainer's `full` ones."""

    version: Version
    kind: Literal["full", "delta", "span", "keyframe"]
    manifest_url: str
    blobs: tuple[BlobSize, ...]
    manifest_bytes: NonNegative = 0


class Plan(Strict):
    """The cheapest chain from `from_version` (None: nothing held) to `to_version`.

    `total_bytes` counts the steps' blobs (each once), `manifest_bytes` their manifests'
    stored sizes (what a client that does not accept gzip downloads; less on the wire
    when it does). The chain chosen is the one with the fewest of both together.
    """

    run: RunName
    from_version: Version | None
    to_version: Version
    steps: tuple[PlanStep, ...]
    total_bytes: NonNegative
    manifest_bytes: NonNegative = 0
    strategy: Literal["deltas", "keyframe+deltas", "spans", "keyframe+spans", "noop"]


class Heartbeat(Strict):
    node_id: str = Field(min_length=1, max_length=256)
    version: Version | None
    engine: str = Field(default="", max_length=128)
    meta: Meta = Field(default_factory=dict)


class FleetNode(Strict):
    node_id: str
    version: Version | None
    engine: str
    meta: Meta
    last_seen: Float


class RetentionPolicy(Strict):
    keep_last: Int = Field(default=64, ge=1)
    grace_s: Float = Field(default=3600.0, ge=0)


class RetentionReport(Strict):
    deleted_manifests: tuple[int, ...]
    deleted_blobs: int
    kept_versions: tuple[int, ...]


class ErrorDetail(BaseModel):
    """`code` (an `ErrorCode`) and `message`, plus fields some codes add (`details`,
    `missing`, `head`, `holder`, ...)."""

    model_config = ConfigDict(extra="allow")
    code: str
    message: str


class ErrorBody(BaseModel):
    """Every error answer of the board: `{"error": {"code", "message", ...}}`."""

    error: ErrorDetail
