"""Wire schemas of the board contract (pydantic).

Everything that crosses a process boundary (manifests in the object store, HTTP bodies
between publisher, board and followers) is one of these models. They are the contract:
change them only together with docs/contract.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MANIFEST_FORMAT: Literal["deltaboard/manifest/v1"] = "deltaboard/manifest/v1"

# Names that end up in object-store keys and file paths: no traversal, no separators.
RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
# Asset names may live in one sub-folder level (e.g. "tokenizer/vocab.json") but never climb out.
ASSET_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}(/[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$")

# Versions are positive and bounded so that nobody can ask the board to walk 2**63 keys.
MAX_VERSION = 10**12
Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]
Sha256 = Annotated[str, Field(pattern=SHA256_RE.pattern)]
RunName = Annotated[str, Field(pattern=RUN_NAME_RE.pattern)]


class Strict(BaseModel):
    """Base: unknown fields are a client mistake, not something to drop silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ViewRule(Strict):
    """Serve tensors whose name matches `pattern` (fnmatch glob) in `dtype`."""

    pattern: str
    dtype: Literal["bf16", "fp16", "fp32", "raw"]


class ViewSpec(Strict):
    """How the trainer's parameters become the bytes the engine serves.

    Floating tensors are cast to `default_dtype` unless a rule (first match wins) says
    otherwise; integer and fp8 tensors always pass through as raw bytes. Shards are cut at
    `shard_max_bytes` in state-dict order, like Hugging Face's `save_pretrained`.
    """

    default_dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    rules: tuple[ViewRule, ...] = ()
    shard_max_bytes: int = Field(default=5 * 2**30, gt=0)


class BlobRef(Strict):
    """A byte range of a content-addressed blob: many small tensor patches share one blob."""

    sha256: Sha256
    offset: int = Field(ge=0)
    length: int = Field(ge=0)


class TensorEntry(Strict):
    """One tensor of a version.

    `dtype` is the safetensors dtype name of the served bytes (BF16, F16, F32, F8_E4M3,
    I64, ...). `file` is the shard file the tensor lives in. `blob` holds the codec's
    patch (kind delta) or keyframe encoding (kind full); the codec's header says which.
    `digest` is the codec's digest of the tensor bytes this entry produces.
    """

    name: str = Field(min_length=1, max_length=512)
    dtype: str
    shape: tuple[int, ...]
    file: str
    blob: BlobRef
    digest: str
    changed: int = Field(ge=0)


class ManifestStats(Strict):
    changed_elements: int = Field(ge=0)
    total_elements: int = Field(ge=0)
    encoded_bytes: int = Field(ge=0)
    view_bytes: int = Field(ge=0)


class Manifest(Strict):
    """An immutable version. A delta lists only the tensors that changed; the layout
    (every tensor's file, dtype, shape, order) is the one of the nearest keyframe."""

    format: Literal["deltaboard/manifest/v1"] = MANIFEST_FORMAT
    run: RunName
    version: Version
    parent: Version | None
    kind: Literal["full", "delta"]
    view: ViewSpec
    epoch: int = Field(ge=0)
    created_at: float
    meta: dict[str, Any] = Field(default_factory=dict)
    tensors: tuple[TensorEntry, ...]
    state_digest: str
    stats: ManifestStats

    def blob_shas(self) -> set[str]:
        return {t.blob.sha256 for t in self.tensors}


# ---- HTTP bodies -------------------------------------------------------------------


class RunCreate(Strict):
    name: RunName
    meta: dict[str, Any] = Field(default_factory=dict)


class RunInfo(Strict):
    name: RunName
    created_at: float
    meta: dict[str, Any]
    head: Version | None
    assets: tuple[str, ...]


class LeaseRequest(Strict):
    """`steal`: take the lease even while another holder's is live (a replacement trainer)."""

    holder: str = Field(min_length=1, max_length=256)
    ttl_s: float = Field(default=60.0, gt=0, le=3600)
    steal: bool = False


class LeaseRenew(Strict):
    holder: str = Field(min_length=1, max_length=256)
    epoch: int = Field(ge=0)
    ttl_s: float = Field(default=60.0, gt=0, le=3600)


class Lease(Strict):
    run: RunName
    holder: str
    epoch: int
    expires_at: float


class BlobUploadTarget(Strict):
    """Where to PUT a blob. `exists` means the board already holds it (dedup): skip."""

    sha256: Sha256
    exists: bool
    url: str | None
    method: Literal["PUT"] = "PUT"
    headers: dict[str, str] = Field(default_factory=dict)


class CommitRequest(Strict):
    manifest: Manifest


class Head(Strict):
    run: RunName
    version: Version | None
    kind: Literal["full", "delta"] | None = None
    epoch: int | None = None


class BlobSize(Strict):
    sha256: Sha256
    size: int = Field(ge=0)


class PlanStep(Strict):
    version: Version
    kind: Literal["full", "delta"]
    manifest_url: str
    blobs: tuple[BlobSize, ...]


class Plan(Strict):
    """The cheapest chain from `from_version` (None: nothing held) to `to_version`."""

    run: RunName
    from_version: Version | None
    to_version: Version
    steps: tuple[PlanStep, ...]
    total_bytes: int
    strategy: Literal["deltas", "keyframe+deltas", "noop"]


class Heartbeat(Strict):
    node_id: str = Field(min_length=1, max_length=256)
    version: Version | None
    engine: str = Field(default="", max_length=128)
    meta: dict[str, Any] = Field(default_factory=dict)


class FleetNode(Strict):
    node_id: str
    version: Version | None
    engine: str
    meta: dict[str, Any]
    last_seen: float


class RetentionPolicy(Strict):
    keep_last: int = Field(default=64, ge=1)
    grace_s: float = Field(default=3600.0, ge=0)


class RetentionReport(Strict):
    deleted_manifests: tuple[int, ...]
    deleted_blobs: int
    kept_versions: tuple[int, ...]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail
