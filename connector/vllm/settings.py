"""The connector's and the tier's settings: parsed once, at start-up, into frozen typed objects.

``ConnectorSettings`` is the standalone connector's ``kv_connector_extra_config``; ``TierSettings`` is the tier's
entry of ``secondary_tiers`` (less the ``type``, ``module_path`` and ``backpressure`` keys vLLM takes for itself).
A key neither knows is refused with a message naming it and the known ones, so a misspelt key fails at start-up
instead of being silently ignored; a value of the wrong type is refused the same way.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

from connector.http.client import ClientConfig
from connector.planning.cost import CostSettings
from contract.wire import ALGORITHMS, CRC64NVME

MIB = 1024 * 1024


class SettingsError(ValueError):
    """A key that is not known, or a value of the wrong type, in the connector's or the tier's configuration."""


def _coerce(*, where: str, name: str, kind: Any, value: Any) -> Any:
    """``value`` as ``kind`` (bool, int, float, str, or str | None); SettingsError when it is not one."""
    optional = kind == "str | None" or kind == (str | None)
    if value is None:
        if optional:
            return None
        raise SettingsError(f"{where} key {name!r} may not be null")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise SettingsError(f"{where} key {name!r} must be true or false, not {value!r}")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise SettingsError(f"{where} key {name!r} must be an integer, not {value!r}")
        try:
            return int(value)
        except ValueError as exc:
            raise SettingsError(f"{where} key {name!r} must be an integer, not {value!r}") from exc
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise SettingsError(f"{where} key {name!r} must be a number, not {value!r}")
        try:
            return float(value)
        except ValueError as exc:
            raise SettingsError(f"{where} key {name!r} must be a number, not {value!r}") from exc
    if not isinstance(value, str):
        raise SettingsError(f"{where} key {name!r} must be a string, not {value!r}")
    return value


def _check_algorithm(where: str, value: str) -> None:
    if value not in ALGORITHMS:
        raise SettingsError(f"{where} key 'checksum' must be one of {', '.join(map(repr, ALGORITHMS))}, not {value!r}")


class _Parsed:
    """``parse(mapping)``: every key must be a field; each value is checked against the field's type."""

    __slots__ = ()
    WHERE: typing.ClassVar[str] = "settings"

    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> Self:
        raw = dict(raw or {})
        known = cls.known_keys()
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise SettingsError(
                f"unknown {cls.WHERE} key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(known)}"
            )
        missing = [
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.name not in raw and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ]
        if missing:
            raise SettingsError(f"{cls.WHERE} needs the key{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        values = {k: _coerce(where=cls.WHERE, name=k, kind=hints[k], value=v) for k, v in raw.items()}
        return cls(**values)


class _ClientFields(typing.TypedDict, total=False):
    """What a way into vLLM names in its own keys; the client's defaults stand for the rest."""

    base_url: typing.Required[str]
    connect_timeout_s: float
    request_timeout_s: float
    lookup_timeout_s: float
    max_inflight_bytes: int
    retries: int
    down_cooldown_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class _ClientSettings(_Parsed):
    """The keys both ways into vLLM share, and the ONE mapping of a way's keys onto the client's configuration."""

    max_connections: int = 32
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    checksum: str = CRC64NVME

    def __post_init__(self) -> None:
        _check_algorithm(self.WHERE, self.checksum)

    def client_config(self) -> ClientConfig:
        return ClientConfig(
            checksum=self.checksum,
            max_connections=self.max_connections,
            ca_file=self.ca_file,
            cert_file=self.cert_file,
            key_file=self.key_file,
            **self._client_fields(),
        )

    def _client_fields(self) -> _ClientFields:
        """The client's fields from this way's own keys (its names, units and defaults)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectorSettings(_ClientSettings):
    """``kv_connector_extra_config`` of the standalone ``KVGateConnector`` (connector/vllm/connector.py)."""

    WHERE: typing.ClassVar[str] = "kv_connector_extra_config"

    url: str = "http://127.0.0.1:8750"
    timeout_s: float = 30.0
    lookup_timeout_s: float = 2.0
    lookup_wait_ms: float = 20.0
    """The longest an engine step with nothing scheduled waits for a lookup in flight (a step with work: never)."""
    load_wait_ms: float = 20.0
    """The longest an engine step with nothing scheduled waits for a load in flight (a step with work: never)."""
    max_inflight_mib: int = 1024
    retries: int = 3
    blocks_per_batch: int = 16
    store_buffers: int = 8
    load_buffers: int = 4
    load: bool = True
    store: bool = True
    lookup_deadline_ms: float = 500.0
    """A request's lookup with no answer by then is a miss (the request is computed), never a longer wait."""
    load_deadline_min_ms: float = 500.0
    load_deadline_max_ms: float = 5000.0
    """The longest a request waits for its load: the cost model loads the prefix that fits, and every deadline is
    at most this."""
    load_deadline_factor: float = 2.0
    """A load's deadline: its predicted time times this (within the two bounds above)."""
    load_bandwidth_mib_s: float = 1000.0
    """The load bandwidth assumed until loads measure it (and drifted back to while none does)."""
    bandwidth_half_life_s: float = 30.0
    prefill_tokens_per_s: float = 0.0
    """The engine's prefill rate to start from (it is then learnt from the engine's steps); 0: unknown until
    measured (a hit is then loaded whenever it fits ``load_deadline_max_ms``)."""
    cost_model: bool = True
    """False: every hit is loaded whole, with the longest deadline (``load_deadline_max_ms``), whatever the cost model
    predicts (correctness runs, A/B runs against the model)."""
    handoff_wait_ms: float = 2000.0
    """P/D consumer: the longest its lookup waits on the gateway for the blocks its producer named (then it loads
    what is there and recomputes the rest); never longer than its predicted recompute behind the prefills queued
    ahead of it, once a prefill rate is measured."""
    handoff_store_wait_ms: float = 5000.0
    """P/D producer: the longest its step waits for buffer room for a P/D request's store rather than drop it."""
    prefetch_budget_mib: int = 0
    """Fetch at arrival: the most host memory (MiB, per worker rank) held for the blocks of requests not admitted
    yet, fetched when vLLM first sees them; 0: no prefetch (a request is looked up when the scheduler reaches it)."""

    def cost_settings(self) -> CostSettings:
        return CostSettings(
            bandwidth_prior_bytes_s=self.load_bandwidth_mib_s * MIB,
            bandwidth_half_life_s=self.bandwidth_half_life_s,
            prefill_tokens_s=self.prefill_tokens_per_s,
            always_load=not self.cost_model,
            deadline_factor=self.load_deadline_factor,
            min_deadline_s=self.load_deadline_min_ms / 1000,
            max_deadline_s=self.load_deadline_max_ms / 1000,
        )

    def _client_fields(self) -> _ClientFields:
        return {
            "base_url": self.url,
            "request_timeout_s": self.timeout_s,
            "lookup_timeout_s": self.lookup_timeout_s,
            "max_inflight_bytes": self.max_inflight_mib * MIB,
            "retries": self.retries,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TierSettings(_ClientSettings):
    """The tier's entry of ``secondary_tiers`` (connector/vllm/tier.py), without the keys vLLM keeps."""

    WHERE: typing.ClassVar[str] = "KVGateTier"

    url: str
    max_inflight_bytes: int = 256 * MIB
    connect_timeout_s: float = 0.5
    lookup_timeout_s: float = 0.5
    transfer_timeout_s: float = 30.0
    load_deadline_ms: float = 5000.0
    """The longest a load job may take: then the rows that arrived are reported loaded, the others recomputed."""
    retries: int = 1
    down_cooldown_s: float = 2.0
    lookup_batch_keys: int = 4096
    enable_kv_events: bool = False
    locality: str | None = None

    def _client_fields(self) -> _ClientFields:
        return {
            "base_url": self.url.rstrip("/"),
            "connect_timeout_s": self.connect_timeout_s,
            "request_timeout_s": self.transfer_timeout_s,
            "lookup_timeout_s": self.lookup_timeout_s,
            "max_inflight_bytes": self.max_inflight_bytes,
            "retries": self.retries,
            "down_cooldown_s": self.down_cooldown_s,
        }
