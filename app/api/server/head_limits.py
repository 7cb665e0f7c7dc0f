"""The request head's bounds in uvicorn's httptools protocol: its size and the time it takes to arrive.

httptools itself has no limit on the request line and headers (h11's ``h11_max_incomplete_event_size`` does not
apply to it), so :func:`bounded_httptools` subclasses uvicorn's protocol (built for uvicorn <0.56, pinned in
pyproject.toml) to answer 431 past ``max_header_bytes`` and 408 when the headers take longer than
``header_timeout_s``; a request uvicorn cannot parse gets the JSON 400 every other error is.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.errors import error_body, response_for
from app.errors import HeadersTooLarge

log = logging.getLogger("kvgate.limits")


def _raw_error(status: int, reason: str, code: str, message: str) -> bytes:
    body = json.dumps(error_body(code, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


async def _headers_too_large(scope: Scope, receive: Receive, send: Send) -> None:
    exc = HeadersTooLarge("request line and headers are over the limit")
    response = response_for(exc)
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


def bounded_httptools(
    *, max_header_bytes: int, header_timeout_s: float, base: type[HttpToolsProtocol] = HttpToolsProtocol
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (or ``base``, a subclass of it) with a bound on the request head's size and on
    the time it takes to arrive."""

    parent: Any = base  # a class chosen at run time: its attributes are uvicorn's protocol's

    class BoundedHttpToolsProtocol(parent):  # type: ignore[misc]
        app: Any  # uvicorn's (annotations only: no class attribute)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._awaiting_head = True
            self._head_timer: asyncio.TimerHandle | None = None
            self._head_deadline: float | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head:
                self._head_bytes += len(data)
                self._arm()
            super().data_received(data)
            if self._awaiting_head and self._head_bytes > max_header_bytes and not self.transport.is_closing():
                log.warning("request head over %s bytes from %s", max_header_bytes, self.client)
                self._reject(
                    _raw_error(
                        431,
                        "Request Header Fields Too Large",
                        "headers_too_large",
                        f"request line and headers over {max_header_bytes} bytes",
                    )
                )

        def on_headers_complete(self) -> None:
            self._awaiting_head = False
            self._head_bytes = 0
            self._disarm()
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size <= max_header_bytes:
                super().on_headers_complete()
                return
            log.warning("request head of %s bytes from %s (limit %s)", size, self.client, max_header_bytes)
            app, self.app = self.app, _headers_too_large  # the whole head arrived in one read: answer 431
            self.head_too_large = True  # through the stack: no lane (app/api/server/lanes.py) takes it
            try:
                super().on_headers_complete()
            finally:
                self.app = app
                self.head_too_large = False

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._awaiting_head = True

        def _head_read(self) -> None:
            """A whole head read and answered without the parser (the HEAD lane, app/api/server/lanes.py): as its
            on_headers_complete and on_message_complete would have."""
            self._head_bytes = 0
            self._disarm()
            super()._head_read()

        # The head's deadline is a number; the timer that enforces it is made once and kept: when it fires early
        # (the head it was made for is long done) it re-arms itself for the deadline now in force, if any. A timer
        # made and cancelled for every request of a keep-alive connection cost more than the lane's whole answer.

        def _arm(self) -> None:
            if self._head_deadline is None:
                self._head_deadline = self.loop.time() + header_timeout_s
            if self._head_timer is None:
                # the protocol's loop: asyncio.get_running_loop() makes a getpid() system call each time (3.11)
                self._head_timer = self.loop.call_at(self._head_deadline, self._expired)

        def _disarm(self) -> None:
            self._head_deadline = None

        def _cancel(self) -> None:
            self._head_deadline = None
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
            deadline = self._head_deadline
            if deadline is None:
                return
            if self.loop.time() < deadline:
                self._head_timer = self.loop.call_at(deadline, self._expired)
                return
            self._head_deadline = None
            if not self._awaiting_head or self.transport.is_closing():
                return
            if self._head_bytes == 0 and self.cycle is None:
                self.transport.close()  # connected and said nothing
                return
            if self._head_bytes:
                log.warning("request head not complete after %ss from %s", header_timeout_s, self.client)
                self._reject(
                    _raw_error(
                        408,
                        "Request Timeout",
                        "request_timeout",
                        f"request headers not complete after {header_timeout_s}s",
                    )
                )

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request it cannot parse, as the JSON error every other answer is."""
            self._reject(_raw_error(400, "Bad Request", "invalid_request", msg))

        def _reject(self, payload: bytes) -> None:
            self._cancel()
            self.transport.write(payload)
            self.transport.close()

    BoundedHttpToolsProtocol.max_header_bytes = max_header_bytes  # the HEAD lane's bound too (lanes.py)
    return BoundedHttpToolsProtocol
