"""What BlockClient is configured with (``ClientConfig``, built by connector/vllm/settings.py), what a lookup
answers per key (``LookupSlot``) and what it counts (``ClientStats``); connector.http.client re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from contract.wire import CRC64NVME


@dataclass(frozen=True, slots=True)
class ClientConfig:
    base_url: str = "http://127.0.0.1:8750"
    max_connections: int = 32
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 30.0
    lookup_timeout_s: float = 2.0
    max_inflight_bytes: int = 1 << 30
    retries: int = 3
    backoff_s: float = 0.05
    """The first retry's delay; it doubles per attempt, each wait drawn from [delay, 1.5 delay] (never shorter)."""
    max_retry_after_s: float = 2.0
    """The longest wait a ``Retry-After`` may ask for: longer asks wait this long (a hook must not stall)."""
    down_cooldown_s: float = 1.0
    ca_file: str | None = None
    """PEM bundle of the CAs that sign the gateway's certificate (https URLs); None: the system's store."""
    cert_file: str | None = None
    """Client certificate (PEM, may hold the key too) for a gateway that asks for one (mutual TLS)."""
    key_file: str | None = None
    check_tls_on_start: bool = True
    """With an https URL: one GET /healthz at construction, so a certificate error fails there, loudly."""
    checksum: str = CRC64NVME
    """The checksum sent with every store (``crc64nvme`` or ``sha256``), which the gateway verifies and records."""
    lean_http: bool = True
    """Block PUTs and GETs on connector/http/http1.py's lean HTTP/1.1 pool (its own ``max_connections``), not aiohttp's:
    a fraction of the CPU per request. False: every request on aiohttp."""


@dataclass(frozen=True, slots=True)
class LookupSlot:
    key: str
    present: bool
    size: int | None
    digest: str | None


@dataclass(slots=True)
class ClientStats:
    puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    misses: int = 0
    dropped_stores: int = 0
    """Stores that did not fit the budget of bytes in flight."""
    full_stores: int = 0
    """Stores the gateway refused with 507 (its store is full): dropped, never retried, not an outage."""
    failed_stores: int = 0
    corrupt_reads: int = 0
    retries: int = 0
    extra: dict[str, int] = field(default_factory=dict)
