"""HTTP framing fails closed: an answer sent before the request's body was read in full ends the connection.

uvicorn's httptools protocol keeps a connection alive after any answer. When the app answers a request before its
body has arrived (a 401, a 413 on the declared Content-Length, a bad checksum header, a full store), the parser
still expects the rest of that body, so the client's next request on the connection is read as body bytes and
never answered (or, with a chunked body, taken for a chunk size). :func:`fail_closed` makes the request's cycle
not keep-alive from its head until the parser has read its body's last byte (``on_message_complete``, which for a
request without a body comes in the same parse as its head, before the app runs). An answer started in between is
then sent with ``Connection: close`` and the connection is closed after it: uvicorn's own rule for a cycle that
is not keep-alive (the one its graceful shutdown uses).

Closing, not draining the rest: the rest of a body the client may never send (it stopped after the answer, as
``Expect: 100-continue`` clients and many others do) cannot be told apart from its next request, so no bounded
wait makes the connection safe to reuse. An answer after the whole body was parsed (the usual case, a small
refused PUT included) keeps the connection.

The close lingers, as nginx's ``lingering_close`` does: the connection is half-closed after the answer (FIN) and
what the client still sends is read and dropped (``_Drain``, at most ``LINGER_S`` and ``LINGER_BYTES``) until it
closes too. Closing a socket with unread bytes makes the kernel answer with a reset, and a client still sending its
body (any client that writes the whole body before it reads) then lost the early answer to that reset: a PUT refused
503 while the index was down came back as a connection error. TLS connections close as before: their shutdown
already reads on until the peer's close_notify.

Put it under the lanes (app/api/server/lanes.py): a PUT the PUT lane hands to the stack goes through it too.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

LINGER_S = 5.0
"""The longest a connection closed after an early answer reads on, for the client to stop sending and close."""
LINGER_BYTES = 64 * 1024 * 1024
"""The most it drops meanwhile."""


class _Drain(asyncio.Protocol):
    """The protocol of a connection closed after an early answer: drops what the client still sends until it closes
    (or ``LINGER_S`` or ``LINGER_BYTES`` run out), then hands the end of the connection to the HTTP protocol."""

    def __init__(
        self, *, http: asyncio.Protocol, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop
    ) -> None:
        self._http = http
        self._transport = transport
        self._left = LINGER_BYTES
        self._timer = loop.call_later(LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self._left -= len(data)
        if self._left < 0:
            self._transport.close()

    def eof_received(self) -> bool:
        return False  # the client closed its side: the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        self._timer.cancel()
        self._http.connection_lost(exc)


class _Lingering:
    """The transport as an early-answered request's cycle sees it: its ``close`` lingers (``_Drain``)."""

    def __init__(self, transport: asyncio.Transport, *, loop: asyncio.AbstractEventLoop, http: asyncio.Protocol):
        self._transport = transport
        self._loop = loop
        self._http = http

    def close(self) -> None:
        t = self._transport
        if t.is_closing() or not t.can_write_eof():
            t.close()
            return
        t.set_protocol(_Drain(http=self._http, transport=t, loop=self._loop))
        t.write_eof()  # a FIN once the answer is flushed; reading goes on
        with contextlib.suppress(RuntimeError):
            t.resume_reading()  # the HTTP protocol's flow control may have paused it

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def fail_closed(base: type[HttpToolsProtocol]) -> type[HttpToolsProtocol]:
    """``base`` (uvicorn's httptools protocol or a subclass) closing the connection after an answer sent before
    the request's body was read in full."""

    parent: Any = base  # a class chosen at run time: its attributes are uvicorn's protocol's

    class FailClosedProtocol(parent):  # type: ignore[misc]
        cycle: Any  # uvicorn's (annotations only: no class attribute)
        _unread: Any = None
        """The cycle whose keep-alive is held back until its body is read in full."""

        def on_headers_complete(self) -> None:
            before = self.cycle
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not before and cycle is not None and cycle.keep_alive:
                cycle.keep_alive = False
                cycle.transport = _Lingering(cycle.transport, loop=self.loop, http=self)
                self._unread = cycle

        def on_message_complete(self) -> None:
            cycle = self._unread
            if cycle is not None and cycle is self.cycle:
                self._unread = None
                if not cycle.response_started:  # an answer begun has said Connection: close: it keeps its word
                    cycle.keep_alive = True
                    cycle.transport = self.transport  # nothing to linger for: the answer writes straight to it
            super().on_message_complete()

        def shutdown(self) -> None:
            self._unread = None  # uvicorn's graceful shutdown: the answer closes the connection, whatever is read
            super().shutdown()

    FailClosedProtocol.__name__ = f"FailClosed{base.__name__}"
    return FailClosedProtocol
