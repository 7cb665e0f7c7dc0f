"""BlockClient: kvgate's HTTP client, on ONE background event-loop thread, so vLLM's sync hooks never wait on I/O.

Sync callers ``submit(coro)`` and get a ``concurrent.futures.Future``; the coroutines (``put``, ``get``,
``lookup``, ...) run on the client's loop. The data path uses aiohttp: measured against a running kvgate
(benchmarks/http_clients.py) it is 3-5x faster than httpx.AsyncClient on 2 MiB GETs and 4-12x on HEAD, and on par
for PUT.

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
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
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
from contract import wire
from contract.wire import BLOCK_META_HEADER, CHECKSUM_HEADER, PART_CHECKSUM_HEADER
from contract.wire import retry_after_s as retry_after_s

try:
    from connector.http.http1 import LeanPool, Target
except ImportError:  # no httptools in the engine's environment (vLLM's own server brings it): aiohttp for all
    LeanPool = None  # type: ignore[assignment, misc]
    Target = Callable[[int], memoryview | None]  # type: ignore[misc]

log = logging.getLogger("kvgate.connector.client")
T = TypeVar("T")
Buffer = bytes | bytearray | memoryview


def _read_whole(status: int) -> None:
    """A GET's answer, whatever its status, read whole as bytes (a PUT's is too, up to a bound: the lean pool's)."""
    return None


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
        """Block PUTs go here (connector/http/http1.py), everything else to the aiohttp session."""
        try:
            self._session: aiohttp.ClientSession = self.run(self._open(), timeout_s=10.0)
            if config.check_tls_on_start and config.base_url.lower().startswith("https://"):
                self.run(
                    check_tls(self._session, self.config.base_url),
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
        return aiohttp.ClientSession(
            base_url=cfg.base_url, connector=connector, timeout=timeout, raise_for_status=False
        )

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
            if self._lean is not None:
                self._lean.close()
            if hasattr(self, "_session"):
                await self._session.close()

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
        """Take ``nbytes`` of the in-flight budget; False when it does not fit (counted as a dropped store unless
        ``count`` is False: a caller that will wait and try again counts the drop itself if it gives up)."""
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

    async def _request(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        read: Callable[[aiohttp.ClientResponse], Awaitable[Any]] | None = None,
        plain: bool = False,
        target_for: Target | None = None,
        **kw: Any,
    ) -> tuple[int, Any]:
        """One request with retries; returns (status, (headers, body)).

        ``read``: reads the body of an answer that is not retried (default: all of it, as bytes). ``plain``: a block
        PUT or GET (``headers``, and a ``data`` buffer to send) that the lean pool sends when it can
        (connector/http/http1.py; its answer's headers are a CIMultiDict, as aiohttp's); ``target_for`` then says where
        the body of an answer goes, as ``read`` does for aiohttp (None: read whole, as bytes). Retried:
        connection errors, timeouts and 502/503/504; every other status is returned as it is. Raises
        GatewayUnavailable (and opens the circuit) when the retries run out, or at once while the circuit is open.
        """
        if self.gateway_down:
            raise GatewayUnavailable(f"gateway marked down for {self._down_until - time.monotonic():.2f}s more")
        lean = self._lean if plain and self._lean is not None and self._lean.sends_as_is(path) else None
        if plain and lean is None and "data" in kw:
            kw["data"] = body.BlockPayload(kw["data"])
        # No per-call timeout: leave the argument out, so the session's timeouts apply (None would disable them).
        if timeout_s is not None and lean is None:
            kw["timeout"] = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self.config.connect_timeout_s)
        delay = self.config.backoff_s
        last = ""
        wait: float | None = None
        headers: Mapping[str, str]
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.stats.retries += 1
                await asyncio.sleep(random.uniform(delay, 1.5 * delay) if wait is None else wait)
                delay *= 2
            wait = None
            try:
                if lean is not None:
                    status, headers, got = await lean.request(
                        method,
                        path,
                        kw.get("headers", {}),
                        kw.get("data", b""),
                        target_for=_read_whole if target_for is None and method == "GET" else target_for,
                        timeout_s=timeout_s,
                    )
                else:
                    async with self._session.request(method, path, **kw) as resp:
                        status, headers = resp.status, resp.headers
                        if status in RETRY_STATUSES:
                            got = await resp.read() if method != "HEAD" else b""
                        elif read is not None:
                            got = await read(resp)
                        else:
                            got = await body.read_all(resp) if method != "HEAD" else b""
                if status in RETRY_STATUSES:
                    last = f"{status} {bytes(got)[:200]!r}"
                    asked = wire.retry_after_s(headers.get("Retry-After"))
                    if asked is not None:
                        wait = min(asked, self.config.max_retry_after_s)
                    continue
                return status, (headers, got)
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as exc:
                if (tls := tls_failure(exc)) is not None:  # configuration: no retry, and a pause as for an outage
                    log.error("TLS to the gateway %s failed: %s", self.config.base_url, tls)
                    self._down_until = time.monotonic() + self.config.down_cooldown_s
                    raise GatewayTLSError(f"{method} {path[:120]}: TLS failed: {tls}") from exc
                last = f"{type(exc).__name__}: {exc}"
            except TimeoutError as exc:
                last = f"timeout: {exc}"
        self._open_circuit(last[:200])  # not answering even after the retries: fail fast for a while
        raise GatewayUnavailable(f"{method} {path[:120]} failed: {last}")

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
        gateway is not down. The checksum is computed here, after the caller's copy fence, and sent for the gateway
        to verify. ``meta``: the block's ``X-KVGate-Block-Meta`` (``wire.format_block_meta``), for the KV events.
        """
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
        status, (_, answer) = await self._request("PUT", f"/v1/blocks/{key}", data=data, headers=headers, plain=True)
        if status == 412:
            return True
        if status == FULL_STATUS:
            self.stats.full_stores += 1
            log.debug("gateway full: store dropped key=%s", key)
            return False
        if status >= 300:
            raise GatewayRejected(status, answer[:300].decode(errors="replace"))
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
        status, (headers, got) = await self._request(
            "GET", f"/v1/blocks/{key}", headers=body.range_header(byte_range), plain=True
        )
        if status == 404:
            self.stats.misses += 1
            return None
        if status not in (200, 206):
            raise GatewayRejected(status, got[:300].decode(errors="replace"))
        view = await self._checked(key, status, headers, memoryview(got), byte_range, expected_digest)
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

        async def read(resp: aiohttp.ClientResponse) -> bytes | int:
            if resp.status == 206 or (resp.status == 200 and byte_range is None):
                return await body.read_into(resp, into)
            return await resp.read()  # an error's text, or the whole object from a server that ignored Range

        def target_for(status: int) -> memoryview | None:
            return into if status == 206 or (status == 200 and byte_range is None) else None

        status, (headers, got) = await self._request(
            "GET",
            f"/v1/blocks/{key}",
            headers=body.range_header(byte_range),
            read=read,
            plain=True,
            target_for=target_for,
        )
        if status == 404:
            self.stats.misses += 1
            return False
        if status not in (200, 206):
            raise GatewayRejected(status, bytes(got)[:300].decode(errors="replace"))
        if isinstance(got, int) and got != size:
            self._corrupt(key, f"a body of {'more than ' if got < 0 else ''}{max(got, size)} bytes, want {size}")
            return False
        received = into if isinstance(got, int) else memoryview(got)
        view = await self._checked(key, status, headers, received, byte_range, expected_digest)
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
        status: int,
        headers: Any,
        received: memoryview,
        byte_range: tuple[int, int] | None,
        expected_digest: str | None,
    ) -> memoryview | None:
        verdict = await body.checked(
            status=status,
            headers=headers,
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
        status, (headers, _) = await self._request("HEAD", f"/v1/blocks/{key}")
        if status == 404:
            return None
        if status != 200:
            raise GatewayRejected(status, "HEAD failed")
        return int(headers.get("Content-Length", "0"))

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
        status, (_, body) = await self._request(
            "POST", "/v1/lookup", json=doc, timeout_s=self.config.lookup_timeout_s + max(0.0, wait_s)
        )
        if status != 200:
            raise GatewayRejected(status, body[:300].decode(errors="replace"))

        answer = json.loads(body)
        slots = [
            LookupSlot(key=s["key"], present=s["present"], size=s.get("size"), digest=wire.unquote_etag(s.get("etag")))
            for s in answer["blocks"]
        ]
        return int(answer["prefix"]), slots

    async def put_config(self, namespace: str, fields: dict[str, Any]) -> None:
        status, (_, body) = await self._request("PUT", f"/v1/namespaces/{namespace}/config", json=fields)
        if status >= 300:
            raise GatewayRejected(status, body[:300].decode(errors="replace"))
