"""Settings: read once, typed, from KVGATE_* environment variables (nested with ``__``) or the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024


class FsBackend(BaseModel):
    """Blocks as files under a data root (the embedded default)."""

    kind: Literal["fs"] = "fs"
    root: Path | None = Field(default=None, description="default: <data_dir>/blocks")
    fsync: bool = True


class S3Backend(BaseModel):
    """Blocks as objects in an S3-compatible bucket (MinIO, Ceph RGW, AWS S3)."""

    kind: Literal["s3"] = "s3"
    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: SecretStr | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "path"
    max_pool_connections: int = 64
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    max_attempts: int = Field(default=3, ge=1, description="tries per S3 call (botocore 'standard' retries)")
    create_bucket: bool = Field(default=True, description="create the bucket at start-up if it is missing")
    multipart_threshold_bytes: int = Field(
        default=8 * MiB, ge=5 * MiB, description="bodies above this go up as a multipart upload"
    )
    part_bytes: int = Field(default=8 * MiB, ge=5 * MiB, description="multipart part size (S3's minimum is 5 MiB)")


class MemoryBackend(BaseModel):
    """Blocks in process memory (tests and throwaway runs)."""

    kind: Literal["memory"] = "memory"


Backend = Annotated[FsBackend | S3Backend | MemoryBackend, Field(discriminator="kind")]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_nested_delimiter="__", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8750
    data_dir: Path = Path("kvgate-data")
    db_url: str | None = Field(default=None, description="default: sqlite+aiosqlite:///<data_dir>/index.db")
    backend: Backend = Field(default_factory=FsBackend)

    max_block_bytes: int = Field(default=256 * MiB, gt=0, description="largest accepted PUT body (413 above)")
    io_chunk_bytes: int = Field(default=4 * MiB, gt=0, description="read/write chunk for block bodies")
    meta_cache_entries: int = Field(default=65536, ge=0, description="block metadata cached in memory")
    meta_cache_ttl_s: float | None = Field(
        default=None, description="seconds a cached entry is trusted; None: forever (one gateway owns the index)"
    )
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = "FULL"
    max_lookup_keys: int = Field(default=4096, gt=0, description="most keys in one POST /v1/lookup")
    access_flush_interval_s: float = Field(default=1.0, gt=0)
    log_level: str = "info"

    @property
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite+aiosqlite:///{(self.data_dir / 'index.db').resolve()}"

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_db_url.startswith("sqlite")

    @model_validator(mode="after")
    def _shared_index_no_meta_cache(self) -> Settings:
        """Several replicas share a PostgreSQL index: a cached HEAD could be stale, so cache nothing by default."""
        if "meta_cache_ttl_s" not in self.model_fields_set and not self.is_sqlite:
            self.meta_cache_ttl_s = 0.0
        return self
