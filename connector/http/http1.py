"""A lean HTTP/1.1 client for the requests the connector makes most: a block's PUT and GET.

Through aiohttp a PUT costs the inference node CPU besides its body (the URL joined and parsed by yarl, the request and
response objects, their timers, the payload writer): a large share of a 2 MiB block's whole store, most of a 64 KiB
one's (docs/benchmarks.md, "Figures behind the code"). The answer to a PUT is a status, a few header lines and at most a
short error text, so none of that is needed: this pool keeps keep-alive connections as plain asyncio protocols, writes
the request's head as one bytes object and the body as the caller's buffer, both in one ``writev`` on a plain connection
(one system call and one segment where there were two, the body not copied; TLS, and whatever the socket does not take
at once, go through the transport, which copies only that rest), and parses the answer with httptools (C, llhttp: the
parser uvicorn uses). A GET's body is received straight into the engine's buffer (:class:`_Connection`), and never again
once its request has failed.

What it does not do is left to aiohttp (connector/http/transport.py: the peer that carries every other request):
a base URL with a path or a query, a key with characters that would need quoting, proxies. Errors surface as
:class:`ConnectionError` (the cause chained: a TLS failure stays visible to ``tls_failure``) and
:class:`TimeoutError`, which the client's one retry loop handles as it handles aiohttp's. A connection that was
idle in the pool and is found closed when a request is written on it (the gateway's keep-alive timeout ran out)
is replaced at once, as a browser does: the request never reached a handler, so sending it again is safe.
"""

from __future__ import annotations

import asyncio
import os
import re
import ssl
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from connector.http.transport import Call, Reply, Target

_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._~/=-]*")
"""Paths sent as they are: what a block key is made of (contract/keys.py), nothing that needs quoting."""
_MAX_ANSWER = 1 << 20
"""The most a PUT's answer may hold: an error text, never a body of that size."""
_SCRATCH_BYTES = 256 << 10
"""Each connection's receive buffer for answer heads and what comes with them (asyncio reads up to 256 KiB)."""


class AnswerLost(ConnectionError):
    """The connection ended (or broke) before the whole answer arrived."""

    def __init__(self, message: str, *, before_answer: bool) -> None:
        super().__init__(message)
        self.before_answer = before_answer
        """Not a byte of the answer had arrived."""


class _Connection(asyncio.BufferedProtocol):
    """One keep-alive connection: at most one request in flight, its answer parsed as it arrives.

    A buffered protocol: the transport receives into a buffer this connection hands it. The head, and whatever
    arrives with it, goes to a scratch buffer and through httptools; once the head says the body goes to a caller's
    buffer and how long it is, the rest of the body is received straight into that buffer (one copy, the kernel's),
    without the parser, and the answer ends when the last byte is there."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        """A view, never the bytearray: asyncio's TLS transport reads the rest of a record into ``buf[offset:]``,
        which of a bytearray is a copy (the bytes would be lost)."""
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[Reply] | None = None
        self._target_for: Target | None = None
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._target: memoryview | None = None
        self._pos = 0
        """Bytes of the body so far (collected, or in the target; -1: more than the target holds)."""
        self._direct_end = -1
        """While the body goes straight into the target: where it ends in it."""
        self._length = -1
        self._began = False
        self._fd = -1
        """The socket's descriptor, where head and body may go out in one ``writev`` (plain TCP; -1: TLS)."""

    # -- asyncio -------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("ssl_object") is None:
            self._fd = sock.fileno()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._direct_end >= 0:
            assert self._target is not None
            return self._target[self._pos : self._direct_end]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._waiter is None:
            self._fail(AnswerLost("the gateway sent bytes no request asked for", before_answer=False))
            return
        self._began = True
        if self._direct_end >= 0:
            self._pos += nbytes
            if self._pos == self._direct_end:
                self._direct_end = -1
                self._complete(self._pos)
            return
        try:
            self._parser.feed_data(self._scratch[:nbytes])
        except httptools.HttpParserError as exc:
            self._fail(AnswerLost(f"the gateway's answer does not parse: {exc}", before_answer=False))
            return
        if self._waiter is not None and self._length > self._pos >= 0 and self._target is not None:
            self._direct_end = self._length  # the rest of the body: straight into the target

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fd = -1  # the transport closes it next
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

    def on_headers_complete(self) -> None:
        parser = self._parser
        self.reusable = parser.should_keep_alive()
        target = None if self._target_for is None else self._target_for(parser.get_status_code())
        if target is None:
            return
        self._target = target
        length = next((v for k, v in self._headers if k.lower() == "content-length"), None)
        if length is not None and length.isdigit() and int(length) <= target.nbytes:  # (llhttp refuses it with chunked)
            self._length = int(length)

    def on_body(self, body: bytes) -> None:
        target = self._target
        if target is None:
            self._pos += len(body)
            if self._target_for is None and self._pos > _MAX_ANSWER:
                raise ValueError("answer too large")  # surfaces from feed_data as a parser error
            self._body.append(body)
        elif self._pos >= 0:
            end = self._pos + len(body)
            if end > target.nbytes:
                self._pos = -1  # outgrew the target: read to its end, kept nowhere
            else:
                target[self._pos : end] = body
                self._pos = end

    def on_message_complete(self) -> None:
        if self._target is not None:
            self._complete(self._pos)
        else:
            self._complete(self._body[0] if len(self._body) == 1 else b"".join(self._body))

    # -- the request ---------------------------------------------------------------------------------------

    def send(
        self, head: bytes, body: memoryview, loop: asyncio.AbstractEventLoop, target_for: Target | None
    ) -> asyncio.Future[Reply]:
        assert self.transport is not None and self._waiter is None
        self._parser = httptools.HttpResponseParser(self)  # a fresh one: the last body may have passed it by
        self._target_for = target_for
        self._headers = []
        self._body = []
        self._target = None
        self._pos = 0
        self._length = -1
        self._began = False
        self.reusable = False
        waiter = self._waiter = loop.create_future()
        sent = 0
        if (
            self._fd >= 0
            and body.nbytes
            and not self.transport.get_write_buffer_size()
            and not self.transport.is_closing()
        ):
            try:  # head and body in one system call and one segment, the body not copied (nor joined to the head)
                sent = os.writev(self._fd, (head, body))
            except OSError:  # would block, or the connection broke: the transport's own write finds out and reports
                sent = 0
        if sent < len(head):
            self.transport.write(head[sent:])
            sent = len(head)
        if sent - len(head) < body.nbytes:
            self.transport.write(body[sent - len(head) :])  # the rest (the transport copies what the socket refuses)
        return waiter

    def _complete(self, body: bytes | int) -> None:
        waiter, self._waiter = self._waiter, None
        self._target = None
        answer = Reply(self._parser.get_status_code(), CIMultiDict(self._headers), body)
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, exc: AnswerLost) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.closed = True
        self._fd = -1
        # nothing more goes into a caller's buffer: its request failed, and the buffer may be another load's next
        # (asyncio's TLS transport still hands the protocol what it decrypts while its close flushes)
        self._target = None
        self._target_for = None
        self._direct_end = -1
        if self.transport is not None:
            self.transport.close()


class LeanPool:
    """Keep-alive connections to one gateway for block PUTs and GETs, at most ``limit`` at once. On the client's
    loop only."""

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

    def carries(self, call: Call) -> bool:
        """A block's PUT or GET: a raw body (or none), a path that goes on the wire as it is."""
        return call.method in ("PUT", "GET") and call.json is None and self.sends_as_is(call.path)

    async def send(self, call: Call) -> Reply:
        """``call`` (one it ``carries``); the reply, its body collected or received into the buffer
        ``call.target_for`` names for its status (a GET's answer without one is read whole, a PUT's up to a bound).
        ConnectionError, TimeoutError."""
        method = call.method
        assert method in ("PUT", "GET"), method
        target_for = _read_whole if call.target_for is None and method == "GET" else call.target_for
        view = memoryview(b"" if call.data is None else call.data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")  # bytes, whatever the buffer's items (a tensor's memory: floats, 2-D)
        head = self._head(method, call.path, call.headers, view.nbytes)
        timeout = self.request_timeout_s if call.timeout_s is None else call.timeout_s
        loop = asyncio.get_running_loop()
        async with self._slots:
            deadline = loop.time() + timeout
            while True:
                conn, reused = await self._connection(loop)
                waiter = conn.send(head, view, loop, target_for)
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

    def _head(self, method: str, path: str, headers: Mapping[str, str], size: int) -> bytes:
        lines = [f"{method} {path} HTTP/1.1\r\n".encode("ascii"), self._host_line]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} holds a line break")
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines.append(b"Content-Length: %d\r\n\r\n" % size if size or method == "PUT" else b"\r\n")
        return b"".join(lines)

    async def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _read_whole(status: int) -> None:
    """A GET's answer, whatever its status, read whole as bytes (a PUT's is too, up to a bound: ``_MAX_ANSWER``)."""
    return None


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("no answer from the gateway in time"))
