"""BlockClient: kvgate's HTTP client, on ONE background event-loop thread, so vLLM's sync hooks never wait on I/O.

Sync callers ``submit(coro)`` and get a ``concurrent.futures.Future``; the coroutines (``put``, ``get``,
``lookup``, ...) run on the client's loop. Each request goes as a ``Call`` to the first of two peer transports that
carries it and comes back as a typed ``Reply`` (connector/http/transport.py): the lean HTTP/1.1 pool for a block's
PUT and GET (connector/http/http1.py), aiohttp for the rest: aiohttp, rather than httpx.AsyncClient, for its
speed on GETs and HEADs against a running kvgate (benchmarks/primitives/http_clients.py).

- Bounded: a connection pool (``max_connections``), per-call timeouts, and ONE budget of bytes in flight shared by
  every way into vLLM: the connector's stores ``reserve`` (a store that does not fit is dropped and counted, never
  waited for); the tier's transfers wait for room with ``hold``.
- Retries only what may pass: connection errors, timeouts and 502/503/504, with jittered exponential backoff, and
  after a ``Retry-After`` when the gateway sends one (capped at ``max_retry_after_s``). Any other status is answered
  at once. 507 is "gateway full": a store is dropped and counted (``stats.full_stores``), not an outage.
- ONE circuit breaker: when a call fails for want of the gateway (GatewayUnavailable) the gateway is considered
  down for ``down_cooldown_s`` and calls fail at once instead of waiting; a full store never opens it.
- Integrity: a PUT carries the checksum of its body (``X-KVGate-Checksum``: CRC64NVME by default, sha256 if the
  config asks); a GET of a whole object is verified against the version's checksum (the header, or the ETag), a
  range against the gateway's ``X-KVGate-Range-Checksum`` of exactly those bytes, and a 200 answer to a range request
  (an intermediary that dropped the Range) as the whole object, before the range is sliced out of it. A mismatch, an
  answer that carries nothing to check against, or a short read is a miss (None) plus a logged error, never data
  handed to the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import math
import random
import threading
import time
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiohttp

from connector.http import body
from connector.http.budget import ByteBudget
from connector.http.checksums import checksum_off_loop
from connector.http.client_types import ClientConfig as ClientConfig
from connector.http.client_types import ClientStats as ClientStats
from connector.http.client_types import LookupSlot as LookupSlot
from connector.http.errors import ConnectorError as ConnectorError
from connector.http.errors import GatewayRejected as GatewayRejected
from connector.http.errors import GatewayTLSError as GatewayTLSError
from connector.http.errors import GatewayUnavailable as GatewayUnavailable
from connector.http.tls import check_tls, client_ssl_context, tls_failure
from connector.http.transport import Call, Reply, SessionTransport, Transport
from contract import wire
from contract.wire import BLOCK_META_HEADER, CHECKSUM_HEADER, PART_CHECKSUM_HEADER
from contract.wire import retry_after_s as retry_after_s

try:
    from connector.http.http1 import LeanPool
except ImportError:  # no httptools in the engine's environment (vLLM's own server brings it): aiohttp for all
    LeanPool = None  # type: ignore[assignment, misc]

log = logging.getLogger("kvgate.connector.client")
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


RETRY_STATUSES = frozenset({502, 503, 504})
"""Answers that may pass (a proxy without an upstream, a gateway shedding load, a timeout on the way)."""
FULL_STATUS = 507


class BlockClient:
    """An aiohttp session on its own event-loop thread. Thread-safe: ``submit`` from any thread."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.stats = ClientStats()
        self._down_until = 0.0
        self._loop = asyncio.new_event_loop()
        self.budget = ByteBudget(limit=config.max_inflight_bytes, loop=self._loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvgate-client", daemon=True)
        self._thread.start()
        self._lean: LeanPool | None = None
        """Block PUTs and GETs go here when it carries them (connector/http/http1.py), everything else to aiohttp."""
        self._transports: tuple[Transport, ...] = ()
        """Asked in order; the last (aiohttp) carries every call."""
        try:
            session = self.run(self._open(), timeout_s=10.0)
            if config.check_tls_on_start and config.base_url.lower().startswith("https://"):
                self.run(
                    check_tls(session, self.config.base_url),
                    timeout_s=config.connect_timeout_s + config.request_timeout_s,
                )
        except BaseException:
            self.close()
            raise

    # -- loop plumbing ---------------------------------------------------------------------------------------

    async def _open(self) -> aiohttp.ClientSession:
        cfg = self.config
        tls = client_ssl_context(ca_file=cfg.ca_file, cert_file=cfg.cert_file, key_file=cfg.key_file)
        connector = aiohttp.TCPConnector(limit=cfg.max_connections, ttl_dns_cache=300, ssl=tls)
        timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s)
        if cfg.lean_http and LeanPool is not None and LeanPool.serves(cfg.base_url):
            self._lean = LeanPool(
                cfg.base_url,
                limit=cfg.max_connections,
                ssl_context=tls,
                connect_timeout_s=cfg.connect_timeout_s,
                request_timeout_s=cfg.request_timeout_s,
            )
        session = aiohttp.ClientSession(
            base_url=cfg.base_url, connector=connector, timeout=timeout, raise_for_status=False
        )
        aio = SessionTransport(session, connect_timeout_s=cfg.connect_timeout_s)
        self._transports = (aio,) if self._lean is None else (self._lean, aio)
        return session

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the client's loop; never blocks."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, T], *, timeout_s: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for it (tests, benchmarks, shutdown; not the engine's hooks)."""
        return self.submit(coro).result(timeout=timeout_s)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown() -> None:
            for transport in self._transports:
                await transport.close()

        try:
            self.run(shutdown(), timeout_s=10.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10.0)
            self._loop.close()

    def __enter__(self) -> BlockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- bytes in flight -------------------------------------------------------------------------------------

    def reserve(self, nbytes: int, *, count: bool = True) -> bool:
        """Take ``nbytes`` of the in-flight budget; False when it does not fit, counted as a dropped store
        (``stats.dropped_stores``) unless ``count`` is False: a caller that will wait and try again passes True on
        its last try, so a store it gives up is counted once, here."""
        if self.budget.reserve(nbytes):
            return True
        if count:
            self.stats.dropped_stores += 1
        return False

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` (from any thread); transfers waiting in ``hold`` try again."""
        self.budget.release(nbytes)

    def hold(self, nbytes: int, *, timeout_s: float) -> contextlib.AbstractAsyncContextManager[None]:
        """On the loop: wait (at most ``timeout_s``, then TimeoutError) for ``nbytes`` of the budget; hold them."""
        return self.budget.hold(nbytes, timeout_s=timeout_s)

    @property
    def inflight_bytes(self) -> int:
        return self.budget.used

    # -- the circuit -----------------------------------------------------------------------------------------

    @property
    def gateway_down(self) -> bool:
        """The circuit is open: calls fail at once with GatewayUnavailable until the cool-down ends."""
        return time.monotonic() < self._down_until

    def _open_circuit(self, why: str) -> None:
        if not self.gateway_down:
            log.warning(
                "gateway %s unavailable (%s); circuit open for %.1fs",
                self.config.base_url,
                why,
                self.config.down_cooldown_s,
            )
        self._down_until = time.monotonic() + self.config.down_cooldown_s

    # -- requests --------------------------------------------------------------------------------------------

    async def _request(self, call: Call) -> Reply:
        """``call`` with retries, on the first transport that carries it (connector/http/transport.py): the lean pool
        for a block's PUT or GET, aiohttp for the rest. Retried: connection errors, timeouts and 502/503/504; every
        other status is returned as it is. Raises GatewayUnavailable (and opens the circuit) when the retries run
        out, or at once while the circuit is open; GatewayTLSError at once on a TLS failure."""
        if self.gateway_down:
            raise GatewayUnavailable(f"gateway marked down for {self._down_until - time.monotonic():.2f}s more")
        transport = next(t for t in self._transports if t.carries(call))
        delay = self.config.backoff_s
        last = ""
        wait: float | None = None
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(random.uniform(delay, 1.5 * delay) if wait is None else wait)
                delay *= 2
            wait = None
            try:
                reply = await transport.send(call)
                if reply.status in RETRY_STATUSES:
                    last = f"{reply.status} {reply.text(200)!r}"
                    asked = wire.retry_after_s(reply.headers.get("Retry-After"))
                    if asked is not None:
                        wait = min(asked, self.config.max_retry_after_s)
                    continue
                return reply
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
                if (tls := tls_failure(exc)) is not None:  # configuration: no retry, and a pause as for an outage
                    log.error("TLS to the gateway %s failed: %s", self.config.base_url, tls)
                    self._down_until = time.monotonic() + self.config.down_cooldown_s
                    raise GatewayTLSError(f"{call.method} {call.path[:120]}: TLS failed: {tls}") from exc
                last = f"{type(exc).__name__}: {exc}"
            except TimeoutError as exc:
                last = f"timeout: {exc}"
        self._open_circuit(last[:200])  # not answering even after the retries: fail fast for a while
        raise GatewayUnavailable(f"{call.method} {call.path[:120]} failed: {last}")

    async def put(
        self,
        key: str,
        data: Buffer,
        *,
        content_range: tuple[int, int, int] | None = None,
        create_only: bool = False,
        meta: str | None = None,
    ) -> bool:
        """Store ``data`` under ``key`` (or the part ``[start, end)`` of ``total`` bytes); True once the gateway has it.

        False when the gateway is full (507): the store is dropped and counted in ``stats.full_stores``, the
        gateway is not down; a store that raises is counted in ``stats.failed_stores``. The checksum is computed
        here, after the caller's copy fence, and sent for the gateway to verify. ``meta``: the block's
        ``X-KVGate-Block-Meta`` (``wire.format_block_meta``), for the KV events.
        """
        try:
            return await self._put(key, data, content_range=content_range, create_only=create_only, meta=meta)
        except Exception:
            self.stats.failed_stores += 1
            raise

    async def _put(
        self,
        key: str,
        data: Buffer,
        *,
        content_range: tuple[int, int, int] | None,
        create_only: bool,
        meta: str | None,
    ) -> bool:
        checksum = await checksum_off_loop(data, self.config.checksum)
        headers = {"Content-Type": "application/octet-stream"}
        if content_range is None:
            headers[CHECKSUM_HEADER] = checksum.header
        else:
            start, end, total = content_range
            headers["Content-Range"] = wire.format_content_range(start=start, end=end, total=total)
            headers[PART_CHECKSUM_HEADER] = checksum.header
        if create_only:
            headers["If-None-Match"] = "*"
        if meta is not None:
            headers[BLOCK_META_HEADER] = meta
        reply = await self._request(Call("PUT", f"/v1/blocks/{key}", headers, data=data))
        if reply.status == 412:
            return True
        if reply.status == FULL_STATUS:
            self.stats.full_stores += 1
            log.debug("gateway full: store dropped key=%s", key)
            return False
        if reply.status >= 300:
            raise GatewayRejected(reply.status, reply.text())
        self.stats.puts += 1
        self.stats.put_bytes += len(data)
        return True

    async def get(
        self, key: str, *, byte_range: tuple[int, int] | None = None, expected_digest: str | None = None
    ) -> bytes | None:
        """The object's bytes (or ``[start, end)`` of them); None on a miss, a short read or a checksum mismatch.

        Every byte returned was checked: a whole object against ``expected_digest`` (a checksum token, e.g. from a
        lookup) or, failing that, the version's checksum the gateway sends (``X-KVGate-Checksum``, else the ETag); a
        206 against the gateway's ``X-KVGate-Range-Checksum`` of exactly the range (or an earlier gateway's
        ``X-KVGate-Range-SHA256``); a 200 answer to a range request as the whole object, then sliced. An answer with
        nothing to check against is refused.
        """
        reply = await self._request(Call("GET", f"/v1/blocks/{key}", body.range_header(byte_range)))
        if reply.status == 404:
            self.stats.misses += 1
            return None
        if reply.status not in (200, 206):
            raise GatewayRejected(reply.status, reply.text())
        got = reply.body
        assert isinstance(got, bytes)  # no target: read whole
        view = await self._checked(key, reply, memoryview(got), byte_range, expected_digest)
        if view is None:
            return None
        return got if view.nbytes == len(got) else bytes(view)

    async def get_into(
        self,
        key: str,
        into: memoryview,
        *,
        byte_range: tuple[int, int] | None = None,
        expected_digest: str | None = None,
    ) -> bool:
        """``get`` that writes the bytes into ``into`` (exactly their size) as they arrive: no other copy of them.

        True once they are there and verified as ``get`` verifies them; False on a miss, a short or long body or a
        checksum mismatch (``into`` then holds bytes that must not be used)."""
        size = into.nbytes

        def target_for(status: int) -> memoryview | None:
            # else an error's text, or the whole object from a server that ignored Range: read whole
            return into if status == 206 or (status == 200 and byte_range is None) else None

        reply = await self._request(
            Call("GET", f"/v1/blocks/{key}", body.range_header(byte_range), target_for=target_for)
        )
        if reply.status == 404:
            self.stats.misses += 1
            return False
        if reply.status not in (200, 206):
            raise GatewayRejected(reply.status, reply.text())
        got = reply.body
        if isinstance(got, int) and got != size:
            self._corrupt(key, f"a body of {'more than ' if got < 0 else ''}{max(got, size)} bytes, want {size}")
            return False
        received = into if isinstance(got, int) else memoryview(got)
        view = await self._checked(key, reply, received, byte_range, expected_digest)
        if view is None:
            return False
        if view.nbytes != size:
            self._corrupt(key, f"{view.nbytes} bytes, want {size}")
            return False
        if view.obj is not into.obj:
            into[:] = view
        return True

    async def _checked(
        self,
        key: str,
        reply: Reply,
        received: memoryview,
        byte_range: tuple[int, int] | None,
        expected_digest: str | None,
    ) -> memoryview | None:
        verdict = await body.checked(
            status=reply.status,
            headers=reply.headers,
            body=received,
            byte_range=byte_range,
            expected_digest=expected_digest,
        )
        if isinstance(verdict, str):
            self._corrupt(key, verdict)
            return None
        self.stats.gets += 1
        self.stats.get_bytes += verdict.nbytes
        return verdict

    def _corrupt(self, key: str, why: str) -> None:
        self.stats.corrupt_reads += 1
        self.stats.misses += 1
        log.error("discarding block key=%s: %s", key, why)

    async def head(self, key: str) -> int | None:
        reply = await self._request(Call("HEAD", f"/v1/blocks/{key}"))
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise GatewayRejected(reply.status, "HEAD failed")
        return int(reply.headers.get("Content-Length", "0"))

    async def lookup(
        self, keys: Sequence[str], *, wait_s: float = 0.0, min_prefix: int | None = None
    ) -> tuple[int, list[LookupSlot]]:
        """One ``POST /v1/lookup``: the longest present prefix of ``keys`` and each key's slot. ``wait_s``: the
        gateway waits up to that long for at least ``min_prefix`` keys (None: all) to be present first."""
        if not keys:
            return 0, []
        doc: dict[str, Any] = {"keys": list(keys)}
        if wait_s > 0:
            doc["wait_ms"] = math.ceil(wait_s * 1000)
            if min_prefix is not None:
                doc["min_prefix"] = min_prefix
        reply = await self._request(
            Call("POST", "/v1/lookup", json=doc, timeout_s=self.config.lookup_timeout_s + max(0.0, wait_s))
        )
        if reply.status != 200:
            raise GatewayRejected(reply.status, reply.text())
        assert isinstance(reply.body, bytes)  # no target: read whole
        answer = json.loads(reply.body)
        slots = [
            LookupSlot(key=s["key"], present=s["present"], size=s.get("size"), digest=wire.unquote_etag(s.get("etag")))
            for s in answer["blocks"]
        ]
        return int(answer["prefix"]), slots

    async def put_config(self, namespace: str, fields: dict[str, Any]) -> None:
        reply = await self._request(Call("PUT", f"/v1/namespaces/{namespace}/config", json=fields))
        if reply.status >= 300:
            raise GatewayRejected(reply.status, reply.text())
