"""A lean HTTP/1.1 client for the request the connector makes most: a block's PUT.

Through aiohttp a PUT costs the inference node ~0.25 ms of CPU besides its body (the URL joined and parsed by
yarl, the request and response objects, their timers, the payload writer): a quarter of a 2 MiB block's whole
store, most of a 64 KiB one's. The answer to a PUT is a status, a few header lines and at most a short error text,
so none of that is needed: this pool keeps keep-alive connections as plain asyncio protocols, writes the request's
head as one bytes object and the body as the caller's buffer (two writes: the gateway's PUT lane takes a body that
follows its head, and the buffer is not copied unless the socket takes only part of it), and parses the answer
with httptools (C, llhttp: the parser uvicorn uses).

What it does not do is left to aiohttp, which :class:`connector.client.BlockClient` keeps for every other request:
a base URL with a path or a query, a key with characters that would need quoting, proxies. Errors surface as
:class:`ConnectionError` (the cause chained: a TLS failure stays visible to ``tls_failure``) and
:class:`TimeoutError`, which the client's one retry loop handles as it handles aiohttp's. A connection that was
idle in the pool and is found closed when a request is written on it (the gateway's keep-alive timeout ran out)
is replaced at once, as a browser does: the request never reached a handler, so sending it again is safe.
"""

from __future__ import annotations

import asyncio
import re
import ssl
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

Buffer = bytes | bytearray | memoryview

_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._~/=-]*")
"""Paths sent as they are: what a block key is made of (contract/keys.py), nothing that needs quoting."""
_MAX_ANSWER = 1 << 20
"""The most a PUT's answer may hold: an error text, never a body of that size."""


class Answer(NamedTuple):
    status: int
    headers: CIMultiDict[str]
    body: bytes


class AnswerLost(ConnectionError):
    """The connection ended (or broke) before the whole answer arrived."""

    def __init__(self, message: str, *, before_answer: bool) -> None:
        super().__init__(message)
        self.before_answer = before_answer
        """Not a byte of the answer had arrived."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection: at most one request in flight, its answer parsed as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Answer] | None = None
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._size = 0
        self._began = False

    # -- asyncio -------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._waiter is None:
            self._fail(AnswerLost("the gateway sent bytes no request asked for", before_answer=False))
            return
        self._began = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(AnswerLost(f"the gateway's answer does not parse: {exc}", before_answer=False))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            lost = AnswerLost(
                f"the connection ended before the answer did{f': {exc}' if exc else ''}",
                before_answer=not self._began,
            )
            lost.__cause__ = exc
            self._waiter.set_exception(lost)
        self._waiter = None

    # -- httptools -----------------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self._waiter is None:  # a second answer behind the one asked for (in the same read)
            raise ValueError("the gateway sent an answer no request asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self._size += len(body)
        if self._size > _MAX_ANSWER:
            raise ValueError("answer too large")  # surfaces from feed_data as a parser error
        self._body.append(body)

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        self.reusable = self._parser.should_keep_alive()
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        answer = Answer(self._parser.get_status_code(), CIMultiDict(self._headers), body)
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    # -- the request ---------------------------------------------------------------------------------------

    def send(self, head: bytes, body: memoryview, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Answer]:
        assert self.transport is not None and self._waiter is None
        self._headers = []
        self._body = []
        self._size = 0
        self._began = False
        self.reusable = False
        waiter = self._waiter = loop.create_future()
        self.transport.write(head)  # alone: the body follows as the caller's buffer, not joined to it
        if body.nbytes:
            self.transport.write(body)
        return waiter

    def _fail(self, exc: AnswerLost) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class LeanPool:
    """Keep-alive connections to one gateway for PUTs, at most ``limit`` at once. On the client's loop only."""

    def __init__(
        self,
        base_url: str,
        *,
        limit: int,
        ssl_context: ssl.SSLContext | bool,
        connect_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        parts = urlsplit(base_url)
        self.host = parts.hostname or ""
        self.tls: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.tls = ssl_context if isinstance(ssl_context, ssl.SSLContext) else ssl.create_default_context()
        self.port = parts.port or (443 if self.tls else 80)
        default_port = parts.port is None or parts.port == (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self._host_line = f"Host: {host if default_port else f'{host}:{self.port}'}\r\n".encode("ascii")
        self.connect_timeout_s = connect_timeout_s
        self.request_timeout_s = request_timeout_s
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(limit)

    @staticmethod
    def serves(base_url: str) -> bool:
        """Whether ``base_url`` is one this pool can talk to (http or https, a host, no path, query or user)."""
        parts = urlsplit(base_url)
        return (
            parts.scheme in ("http", "https")
            and bool(parts.hostname)
            and parts.path in ("", "/")
            and not parts.query
            and not parts.fragment
            and parts.username is None
        )

    @staticmethod
    def sends_as_is(path: str) -> bool:
        """Whether ``path`` goes on the wire as it is (else the caller's other client quotes it)."""
        return _PLAIN_PATH.fullmatch(path) is not None

    async def request(
        self, method: str, path: str, headers: dict[str, str], body: Buffer, *, timeout_s: float | None = None
    ) -> Answer:
        """``method path`` with ``headers`` and ``body``; the answer. ConnectionError, TimeoutError."""
        view = memoryview(body)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # bytes, whatever the buffer's items (a tensor's memory: floats, 2-D)
        head = self._head(method, path, headers, view.nbytes)
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        async with self._slots:
            deadline = loop.time() + timeout
            while True:
                conn, reused = await self._connection(loop)
                waiter = conn.send(head, view, loop)
                timer = loop.call_at(deadline, _expire, waiter)
                try:
                    answer = await waiter
                except AnswerLost as exc:
                    conn.close()
                    if reused and exc.before_answer:
                        continue  # the gateway had closed the idle connection: a fresh one, at once
                    raise
                except BaseException:
                    conn.close()  # a timeout or a cancel: its answer may still come, on no one's request
                    raise
                finally:
                    timer.cancel()
                if conn.reusable and not conn.closed:
                    self._idle.append(conn)
                else:
                    conn.close()
                return answer

    async def _connection(self, loop: asyncio.AbstractEventLoop) -> tuple[_Connection, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn, True
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    _Connection,
                    self.host,
                    self.port,
                    ssl=self.tls,
                    server_hostname=self.host if self.tls else None,
                ),
                self.connect_timeout_s,
            )
        except OSError as exc:  # refused, unreachable, a TLS failure (ssl.SSLError): the cause stays chained
            raise ConnectionError(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        return conn, False

    def _head(self, method: str, path: str, headers: dict[str, str], size: int) -> bytes:
        lines = [f"{method} {path} HTTP/1.1\r\n".encode("ascii"), self._host_line]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} holds a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"Content-Length: %d\r\n\r\n" % size)
        return b"".join(lines)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no answer from the gateway in time"))
