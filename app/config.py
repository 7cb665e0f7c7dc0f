"""Settings: read once, typed, from KVGATE_* environment variables (nested with ``__``) or the CLI."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

MiB = 1024 * 1024
TOPIC_FIELDS = frozenset({"name", "model", "namespace"})
"""What the events' topic template may name."""


def check_topic(template: str) -> frozenset[str]:
    """The fields a topic template uses; ValueError unless they are ``{name}``, ``{model}``, ``{namespace}``."""
    used: set[str] = set()
    for _text, name, spec, conversion in string.Formatter().parse(template):  # ValueError if malformed
        if name is None:
            continue
        if name not in TOPIC_FIELDS or spec or conversion:
            raise ValueError(f"topic field {{{name}}} is not one of {{name}}, {{model}}, {{namespace}}")
        used.add(name)
    return frozenset(used)


class FsBackend(BaseModel):
    """Blocks as files under a data root (the embedded default)."""

    model_config = ConfigDict(extra="forbid")  # KVGATE_BACKEND__BUCKET without __KIND=s3 is a mistake, not a no-op

    kind: Literal["fs"] = Field(default="fs", description="`fs`, `s3` or `memory`")
    root: Path | None = Field(default=None, description="where block files go; none: <data_dir>/blocks")
    fsync: bool = Field(default=True, description="fsync each block file and its directory before the PUT returns")
    inline_io_bytes: int = Field(
        default=4 * MiB,
        ge=0,
        description="file calls that need not wait on the disk run on the event loop instead of a worker thread "
        "(a thread hop costs more CPU than a small write): reads the page cache holds, and their opens; without "
        "fsync, also writing, renaming and discarding a version of at most this many bytes. 0: every file call on "
        "a thread (a data root on network storage, or one whose metadata the kernel cannot keep cached)",
    )


class S3Backend(BaseModel):
    """Blocks as objects in an S3-compatible bucket (SeaweedFS, Ceph RGW, AWS S3, ...)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["s3"] = "s3"
    bucket: str = Field(description="bucket name")
    prefix: str = Field(default="", description="key prefix inside the bucket")
    endpoint_url: str | None = Field(default=None, description="e.g. http://seaweedfs:8333; none: AWS S3")
    region: str = Field(default="us-east-1", description="region (signing, bucket creation)")
    access_key_id: str | None = Field(default=None, description="none: the usual AWS credential chain")
    secret_access_key: SecretStr | None = Field(default=None, description="none: the usual AWS credential chain")
    addressing_style: Literal["auto", "path", "virtual"] = Field(
        default="path", description="`path` for SeaweedFS/Ceph; `virtual` or `auto` for AWS"
    )
    max_pool_connections: int = Field(default=64, gt=0, description="HTTP connections to the store")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="connect timeout per store call")
    read_timeout_s: float = Field(default=30.0, gt=0, description="read timeout per store call")
    max_attempts: int = Field(default=3, ge=1, description="tries per S3 call (botocore 'standard' retries)")
    create_bucket: bool = Field(default=True, description="create the bucket at start-up if it is missing")
    multipart_threshold_bytes: int = Field(
        default=8 * MiB, ge=5 * MiB, description="bodies above this go up as a multipart upload"
    )
    part_bytes: int = Field(default=8 * MiB, ge=5 * MiB, description="multipart part size (S3's minimum is 5 MiB)")


class MemoryBackend(BaseModel):
    """Blocks in process memory (tests and throwaway runs)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["memory"] = "memory"


Backend = Annotated[FsBackend | S3Backend | MemoryBackend, Field(discriminator="kind")]


class TokenSpec(BaseModel):
    """One principal with a role and a scope: a bearer token, stored as the sha256 of its text (``kvgate token
    hash``), and/or a client certificate, named by its subject or one of its subject alternative names."""

    name: str = Field(min_length=1)
    sha256: str | None = Field(
        default=None, pattern=r"^[0-9a-fA-F]{64}$", description="hex sha256 of the token's UTF-8 text"
    )
    cert_subject: str | None = Field(
        default=None,
        min_length=1,
        description="a verified client certificate with this subject (RFC 4514, as `openssl x509 -noout -subject "
        "-nameopt RFC2253` prints it, e.g. CN=node-1,O=acme)",
    )
    cert_san: str | None = Field(
        default=None,
        pattern=r"^(?i:DNS|URI|IP|email):.+$",
        description="a verified client certificate with this subject alternative name, TYPE:value "
        "(DNS:node-1.cluster, URI:spiffe://cluster/node-1, IP:10.0.0.5, email:ops@example.org)",
    )
    role: Literal["read", "write", "admin"]
    namespaces: list[str] | None = Field(default=None, description="namespaces it may touch; None: all")

    @model_validator(mode="after")
    def _has_a_credential(self) -> TokenSpec:
        if self.sha256 is None and self.cert_subject is None and self.cert_san is None:
            raise ValueError(f"principal {self.name!r} needs sha256, cert_subject or cert_san")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", env_nested_delimiter="__", extra="ignore")

    host: str = Field(default="127.0.0.1", description="bind address (any other than loopback needs tokens)")
    port: int = Field(default=8750, ge=0, le=65535, description="port")
    data_dir: Path = Field(default=Path("kvgate-data"), description="data root: blocks/ and the SQLite index.db")
    db_url: str | None = Field(
        default=None,
        description="index URL, sqlite+aiosqlite:///path or postgresql+asyncpg://user:pw@host/db; "
        "none: SQLite in the data dir",
    )
    backend: Backend = Field(default_factory=FsBackend, description="where blocks go")
    workers: int = Field(
        default=1,
        ge=1,
        le=512,
        description="gateway processes serving one socket (`kvgate serve --workers`); one per core uses them all",
    )

    max_block_bytes: int = Field(default=256 * MiB, gt=0, description="largest accepted PUT body (413 above)")
    io_chunk_bytes: int = Field(default=4 * MiB, gt=0, description="read/write chunk for block bodies")
    meta_cache_entries: int = Field(default=65536, ge=0, description="block metadata cached in memory")
    meta_cache_ttl_s: float | None = Field(
        default=None,
        description="seconds a cached HEAD answer is trusted; none: until the key changes (every process on this "
        "machine sees every change: the default with SQLite), 0: never cached (the default with PostgreSQL, whose "
        "replicas on other machines change keys unseen)",
    )
    sqlite_synchronous: Literal["OFF", "NORMAL", "FULL"] = Field(
        default="FULL", description="SQLite durability (FULL: a row survives power loss once the PUT returned)"
    )
    max_lookup_keys: int = Field(default=4096, gt=0, description="most keys in one POST /v1/lookup")
    access_flush_interval_s: float = Field(default=1.0, gt=0, description="seconds between access-time writes")

    max_bytes: int | None = Field(
        default=None, gt=0, description="capacity bound on stored block bytes; none: unbounded"
    )
    high_watermark: float = Field(default=0.95, gt=0, le=1, description="evict when usage passes this share")
    low_watermark: float = Field(default=0.85, gt=0, le=1, description="evict down to this share")
    namespace_quota_bytes: int | None = Field(
        default=None, gt=0, description="bound on a namespace's bytes; none: unbounded"
    )
    eviction_interval_s: float = Field(
        default=5.0, gt=0, description="background eviction check period (usage is read from the index as often)"
    )
    eviction_batch: int = Field(default=256, gt=0, description="LRU candidates fetched per eviction round")
    max_parts_per_object: int = Field(
        default=256, gt=0, description="most parts (Content-Range PUTs) one object is stored as; past it 409"
    )
    stale_upload_s: float = Field(
        default=600.0,
        gt=0,
        description="a multi-part upload with no new part for this long was abandoned by its writers: dropped",
    )
    reconcile_on_start: bool = Field(
        default=True,
        description="reconcile index and store at start-up (safe beside running gateways, replicas and gc: every "
        "change is conditional on the version it observed)",
    )
    reconcile_concurrency: int = Field(default=8, gt=0, description="digests computed at once by reconcile")
    startup_wait_s: float = Field(
        default=120.0,
        ge=0,
        description="start-up keeps trying this long to reach an index or store that is not up yet (PostgreSQL "
        "restarting, S3 not listening) before it gives up (exit 3); 0: one try",
    )
    scrub_interval_s: float = Field(
        default=86400.0,
        ge=0,
        description="every stored block is read back and checked against its row this often (a pass; corrupt "
        "blocks quarantined, their rows removed); 0: no background scrub",
    )
    scrub_delay_s: float = Field(
        default=600.0, ge=0, description="the first scrub pass starts this long after start-up"
    )
    scrub_bytes_per_s: int = Field(
        default=32 * MiB, gt=0, description="the scrub reads at most this many bytes a second (one process at a time)"
    )
    metrics_enabled: bool = Field(default=True, description="serve /metrics and count requests")
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        default="info", description="uvicorn's log level"
    )

    tokens: list[TokenSpec] = Field(
        default_factory=list,
        description="bearer tokens, a JSON list of {name, sha256, role, namespaces}; none: auth off (loopback only)",
    )
    tokens_file: Path | None = Field(default=None, description="JSON or TOML list of tokens, added to `tokens`")
    tokens_reload_interval_s: float = Field(
        default=5.0, ge=0, description="re-read the tokens file when it changes (and on SIGHUP); 0: SIGHUP only"
    )
    metrics_public: bool = Field(default=False, description="serve /metrics without a token")
    max_uploads_in_flight: int = Field(default=256, gt=0, description="PUTs in flight; past it 429 at once")
    max_json_body_bytes: int = Field(default=8 * MiB, gt=0, description="largest non-block request body (413)")
    body_min_rate_bytes_s: float = Field(default=64 * 1024, gt=0, description="slowest accepted body upload")
    body_grace_s: float = Field(default=10.0, ge=0, description="seconds before the minimum rate applies")
    body_idle_timeout_s: float = Field(default=30.0, gt=0, description="longest pause inside a body (408)")
    max_header_bytes: int = Field(default=64 * 1024, gt=0, description="request line + headers (431 above)")
    header_timeout_s: float = Field(default=30.0, gt=0, description="time to send a request's headers")
    head_lane: bool = Field(
        default=True,
        description="answer a HEAD of a block whose row the metadata cache holds inside the HTTP protocol, past the "
        "ASGI stack (the same bytes for about 0.7x the CPU); false: every request goes through the stack",
    )
    get_lane: bool = Field(
        default=True,
        description="answer a GET of a whole block of at most 4 MiB whose row the metadata cache holds and whose "
        "file the page cache holds inside the HTTP protocol, the file sent with sendfile (plain HTTP, the "
        "filesystem store); false: every GET goes through the stack",
    )
    put_lane: bool = Field(
        default=True,
        description="store a PUT of a block of at most 4 MiB whose body is all here within 0.25 s of its head "
        "inside the HTTP protocol, past the ASGI stack (the same answers); false: every PUT goes through the stack",
    )
    limit_concurrency: int | None = Field(default=4096, gt=0, description="uvicorn: connections + tasks (503)")
    sqlite_busy_timeout_s: float = Field(default=30.0, ge=0, description="wait on a locked SQLite index")
    sqlite_mmap_bytes: int = Field(
        default=1024 * MiB,
        ge=0,
        description="SQLite reads the index through a memory map up to this size (faster lookups; an I/O error "
        "reading the file then stops the process instead of failing the request); 0: off",
    )

    tls_certfile: Path | None = Field(default=None, description="serve HTTPS with this certificate chain (PEM)")
    tls_keyfile: Path | None = Field(default=None, description="its private key (PEM); default: in tls_certfile")
    tls_client_ca: Path | None = Field(
        default=None, description="CA bundle (PEM) for client certificates; set: clients may present one"
    )
    tls_client_auth: Literal["required", "optional"] = Field(
        default="required", description="with tls_client_ca: must every client present a certificate"
    )
    tls_min_version: Literal["1.2", "1.3"] = Field(default="1.2", description="the oldest TLS version accepted")
    tls_reload_interval_s: float = Field(
        default=5.0, ge=0, description="re-read the certificate files when they change (and on SIGHUP); 0: SIGHUP only"
    )
    require_tls: bool = Field(default=False, description="refuse to start without TLS")
    root_path: str = Field(
        default="",
        pattern=r"^(/[A-Za-z0-9._~-]+)*$",
        description="the path prefix a proxy serves the gateway under (uvicorn's root_path), e.g. /kvgate",
    )

    events_enabled: bool = Field(
        default=False,
        description="publish KV events of committed changes (ZMQ in vLLM's format, GET /v1/events); the same for "
        "every process of a deployment (gateways, replicas, kvgate gc, kvgate import: each logs its own changes)",
    )
    events_endpoint: str | None = Field(
        default="tcp://127.0.0.1:5557",
        description="ZMQ PUB address, bound by the one process that publishes; empty: GET /v1/events only",
    )
    events_replay_endpoint: str | None = Field(
        default="tcp://127.0.0.1:5558",
        description="ZMQ ROUTER address for replays of missed batches, bound by the publisher; empty: none",
    )
    events_medium: str = Field(
        default="STORAGE", description="the events' `medium`: STORAGE is what vLLM's storage tiers publish"
    )
    events_locality: Literal["LOCAL", "REMOTE", ""] = Field(
        default="",
        description="the events' `locality`; empty: none, as vLLM engines' own events (Dynamo 1.6 drops every event "
        "whose locality is REMOTE)",
    )
    events_ownership: str = Field(
        default="",
        description="the events' `ownership` (a secondary tier's id, e.g. kvgate); empty: none (Dynamo 1.6 drops "
        "every event that names one)",
    )
    events_model_endpoints: dict[str, tuple[str, str]] = Field(
        default_factory=dict,
        description="per model, a ZMQ PUB and a replay address carrying only that model's batches, bound by the "
        'publisher beside the others: JSON {"<model>": ["<pub>", "<replay>"]}, for routers that file all an address '
        "carries under one model (Dynamo 1.6); needs {model} and no {namespace} in events_topic",
    )
    events_topic: str = Field(
        default="kv@pool:{name}@{model}",
        description="ZMQ topic of the batches, a template: {name} (events_pool_name), {model} (the run's model name, "
        "from its namespace config), {namespace}",
    )
    events_pool_name: str = Field(default="kvgate", description="{name} in the events' topic")
    events_encoding: Literal["map", "array"] = Field(
        default="map",
        description="`map`: each event a tagged map, as vLLM 0.33 writes them; `array`: tagged arrays, as vLLM "
        "before #42892 (for decoders that expect those)",
    )
    events_int_hashes: bool = Field(
        default=True, description="block hashes as vLLM's default: low 64 bits as an int (False: the hash's bytes)"
    )
    events_buffer: int = Field(
        default=10_000, gt=0, description="batches kept in the index for replays (the event log is trimmed to them)"
    )
    events_poll_s: float = Field(
        default=0.05,
        gt=0,
        description="how often the publisher and event streams look for changes committed by other processes",
    )
    events_hold_s: float = Field(
        default=60.0,
        gt=0,
        description="longest a child block's event waits for its parent's when the parent's writer died mid-PUT",
    )

    @property
    def tls_enabled(self) -> bool:
        return self.tls_certfile is not None

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_kind_defaults_to_fs(cls, value: object) -> object:
        """``KVGATE_BACKEND__FSYNC=false`` alone means the default backend: the kind need not be spelled out."""
        if isinstance(value, dict) and "kind" not in value:
            return {"kind": "fs", **value}
        return value

    @field_validator("events_topic")
    @classmethod
    def _events_topic_fields(cls, value: str) -> str:
        check_topic(value)
        return value

    @model_validator(mode="after")
    def _model_endpoints_need_model_topics(self) -> Settings:
        """A model's batches are told apart by their topic: one per model, whatever the namespace."""
        if self.events_model_endpoints and check_topic(self.events_topic) & {"model", "namespace"} != {"model"}:
            raise ValueError("events_model_endpoints needs {model} and no {namespace} in events_topic")
        return self

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level_lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def resolved_db_url(self) -> str:
        return self.db_url or f"sqlite+aiosqlite:///{(self.data_dir / 'index.db').resolve()}"

    @property
    def blocks_root(self) -> Path | None:
        """The filesystem backend's data root (absolute), or None for another backend."""
        if not isinstance(self.backend, FsBackend):
            return None
        return (self.backend.root or self.data_dir / "blocks").resolve()

    @property
    def is_sqlite(self) -> bool:
        return self.resolved_db_url.startswith("sqlite")

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> Settings:
        if self.low_watermark > self.high_watermark:
            raise ValueError("low_watermark must not exceed high_watermark")
        return self

    @model_validator(mode="after")
    def _tls_files_complete(self) -> Settings:
        if self.tls_certfile is None and (self.tls_keyfile is not None or self.tls_client_ca is not None):
            raise ValueError("tls_keyfile and tls_client_ca need tls_certfile")
        return self

    @model_validator(mode="after")
    def _workers_share_what_they_can(self) -> Settings:
        """Several workers share the store, the index and the data directory (and the KV event stream: one of them
        publishes it at a time); not the memory backend."""
        if self.workers > 1 and isinstance(self.backend, MemoryBackend):
            raise ValueError("workers > 1 with the memory backend: each worker would keep blocks of its own")
        return self

    @model_validator(mode="after")
    def _shared_index_no_meta_cache(self) -> Settings:
        """Several replicas share a PostgreSQL index: a cached HEAD could be stale, so cache nothing by default."""
        if "meta_cache_ttl_s" not in self.model_fields_set and not self.is_sqlite:
            self.meta_cache_ttl_s = 0.0
        return self
