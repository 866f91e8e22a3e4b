"""Board server settings: every field is a flag of `deltaboard board serve` and an
environment variable `DELTABOARD_<FIELD>` (pydantic-settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DELTABOARD_", extra="ignore")

    data_dir: Path = Path("./deltaboard-data")
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    store: str | None = Field(default=None, description="s3://bucket/prefix; default: <data_dir>/store")
    s3_endpoint: str | None = None
    s3_public_endpoint: str | None = Field(
        default=None, description="endpoint in presigned URLs, if not s3_endpoint"
    )
    s3_region: str = "us-east-1"
    s3_access_key: str | None = None
    s3_secret_key: str | None = None
    # A store that is down or frozen must cost a request a few seconds, not a hang: each S3
    # call gives up after s3_attempts tries of these timeouts (then 503 StoreUnavailable).
    s3_connect_timeout_s: float = Field(default=2.0, gt=0)
    s3_read_timeout_s: float = Field(default=2.0, gt=0)
    s3_attempts: int = Field(default=2, ge=1, description="tries per S3 call, the first included")
    presign_expiry_s: int = Field(default=3600, gt=0)
    redis: str | None = Field(default=None, description="redis://host:port/db for several replicas")
    redis_namespace: str = "deltaboard"
    reconcile_s: float = Field(
        default=5.0, ge=0, description="with Redis: compare heads with the store (0: never)"
    )
    index_check_s: float = Field(
        default=1.0, gt=0, description="with Redis: how often to check that the index was not lost"
    )
    auth_config: Path | None = None
    tokens: str = Field(default="", description="comma-separated scope:token[:run-glob]")
    anonymous_read: bool = False
    max_blob_bytes: int = Field(default=64 * 2**30, gt=0)
    max_body_bytes: int = Field(default=64 * 2**20, gt=0, description="JSON bodies and assets")
    body_idle_timeout_s: float = Field(default=30.0, gt=0, description="give up on a stalled request body")
    max_wait_s: float = Field(default=60.0, gt=0)
    fleet_ttl_s: float = Field(
        default=300.0, gt=0, description="a node not heard from in this long leaves the fleet listing"
    )
    fsync: bool = True
    log_level: str = "warning"
    instance: str = Field(
        default="", description="echoed by /healthz: tells a launcher which process answers"
    )

    @property
    def shared_index(self) -> bool:
        """Only a shared index can miss a commit (a replica dying before its index update)
        or be lost while the board runs (Redis flushed or restarted)."""
        return self.redis is not None

    @property
    def tmp_dir(self) -> Path:
        """Uploads stream here first; same filesystem as the local store, so storing is a rename."""
        return self.data_dir / "tmp"

    @property
    def local_store_dir(self) -> Path:
        return self.data_dir / "store"
