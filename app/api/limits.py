"""Bounds on what one client can hold: uploads in flight, body sizes and rates, header size and time.

- :class:`LimitsMiddleware` (ASGI): PUTs of blocks past ``max_uploads_in_flight`` get 429 at once (never queued);
  other bodies past ``max_json_body_bytes`` get 413; every body is read through a :class:`BodyGuard` that answers
  408 when it trickles in slower than ``body_min_rate_bytes_s`` (after ``body_grace_s``) or pauses longer than
  ``body_idle_timeout_s``. The guard raises inside the handler's read, so the store drops its temp file and
  nothing is published.
- :func:`bounded_httptools` (uvicorn protocol): httptools itself has no limit on the request line and headers
  (h11's ``h11_max_incomplete_event_size`` does not apply to it), so this subclass answers 431 past
  ``max_header_bytes`` and 408 when the headers take longer than ``header_timeout_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from app.api.errors import error_body, response_for
from app.config import Settings
from app.errors import HeadersTooLarge, KVGateError, PayloadTooLarge, RequestTimeout, TooManyRequests

log = logging.getLogger("kvgate.limits")

UPLOAD_PREFIX = "/v1/blocks/"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _declared_length(scope: Scope) -> int | None:
    raw = _header(scope, b"content-length")
    return int(raw) if raw is not None and raw.isdigit() else None


class BodyGuard:
    """The ``receive`` a handler reads its body through: minimum rate, longest pause, optional size bound.

    On a breach it sends the error response itself (``Connection: close``), then raises the error into the
    handler's read; whatever the handler answers afterwards is dropped by :meth:`send`.
    """

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        *,
        min_rate: float,
        grace_s: float,
        idle_s: float,
        max_bytes: int | None,
    ) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._min_rate = min_rate
        self._grace = grace_s
        self._idle = idle_s
        self._max = max_bytes
        self._start = time.monotonic()
        self._received = 0
        self._done = False
        self.failure: KVGateError | None = None

    async def receive(self) -> Message:
        if self._done or self.failure is not None:
            return await self._receive()
        now = time.monotonic()
        deadline = min(now + self._idle, self._start + self._grace + self._received / self._min_rate)
        try:
            with anyio.fail_after(max(deadline - now, 0.0)):
                message = await self._receive()
        except TimeoutError:
            elapsed = time.monotonic() - self._start
            raise await self._fail(
                RequestTimeout(f"request body too slow: {self._received} bytes in {elapsed:.1f}s")
            ) from None
        if message["type"] != "http.request":
            self._done = True
            return message
        self._received += len(message.get("body", b""))
        if self._max is not None and self._received > self._max:
            raise await self._fail(PayloadTooLarge(f"request body over {self._max} bytes"))
        if not message.get("more_body", False):
            self._done = True
        return message

    async def send(self, message: Message) -> None:
        if self.failure is None:
            await self._send(message)

    async def _fail(self, exc: KVGateError) -> KVGateError:
        self.failure = exc
        log.warning("request body refused method=%s path=%s: %s", self._scope["method"], self._scope["path"], exc)
        response = response_for(exc)
        response.headers["Connection"] = "close"
        await response(self._scope, self._receive, self._send)
        return exc


class LimitsMiddleware:
    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.max_uploads = settings.max_uploads_in_flight
        self.max_json = settings.max_json_body_bytes
        self.min_rate = settings.body_min_rate_bytes_s
        self.grace_s = settings.body_grace_s
        self.idle_s = settings.body_idle_timeout_s
        self.uploads = 0
        """Block PUTs in flight (one event loop: a plain counter)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        is_upload = scope["method"] == "PUT" and scope["path"].startswith(UPLOAD_PREFIX)
        length = _declared_length(scope)
        if not is_upload and length is not None and length > self.max_json:
            await response_for(PayloadTooLarge(f"request body over {self.max_json} bytes"))(scope, receive, send)
            return
        if is_upload and self.uploads >= self.max_uploads:
            exc = TooManyRequests(f"{self.uploads} uploads in flight: the gateway takes at most {self.max_uploads}")
            await response_for(exc)(scope, receive, send)
            return
        guard = BodyGuard(
            scope,
            receive,
            send,
            min_rate=self.min_rate,
            grace_s=self.grace_s,
            idle_s=self.idle_s,
            max_bytes=None if is_upload else self.max_json,
        )
        if is_upload:
            self.uploads += 1
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            if guard.failure is None:
                raise
        finally:
            if is_upload:
                self.uploads -= 1


# -- the HTTP protocol: header size and time ---------------------------------------------------------------------


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


def bounded_httptools(*, max_header_bytes: int, header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a bound on the request head's size and on the time it takes to arrive."""

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._head_bytes = 0
            self._awaiting_head = True
            self._head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
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
            try:
                super().on_headers_complete()
            finally:
                self.app = app

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._awaiting_head = True

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expired(self) -> None:
            self._head_timer = None
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
            self._disarm()
            self.transport.write(payload)
            self.transport.close()

    return BoundedHttpToolsProtocol


# -- OpenAPI -----------------------------------------------------------------------------------------------------


def document_limits(spec: dict[str, Any]) -> dict[str, Any]:
    """Document the statuses the limits add: 408/413 on every operation with a body, 429 on block PUTs."""
    ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, ops in spec.get("paths", {}).items():
        for method, op in ops.items():
            if not isinstance(op, dict) or "requestBody" not in op:
                continue
            responses = op.setdefault("responses", {})
            responses.setdefault("408", {"description": "the body arrived too slowly", **ref})
            responses.setdefault("413", {"description": "the body is too large", **ref})
            if method == "put" and path.startswith(UPLOAD_PREFIX):
                responses.setdefault("429", {"description": "too many uploads in flight; see Retry-After", **ref})
    return spec


def extend_openapi(app: FastAPI, edit: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Post-process the generated spec once (chained: each call adds one edit)."""
    base = app.openapi
    done: list[dict[str, Any]] = []

    def openapi() -> dict[str, Any]:
        if not done:
            done.append(edit(base()))
            app.openapi_schema = done[0]
        return done[0]

    app.openapi = openapi  # type: ignore[method-assign]


def install(app: FastAPI, settings: Settings) -> None:
    app.add_middleware(LimitsMiddleware, settings=settings)
    extend_openapi(app, document_limits)
