"""Bounds on what one client can hold: uploads in flight, body sizes and rates, header size and time.

- :class:`LimitsMiddleware` (ASGI): PUTs of blocks past ``max_uploads_in_flight`` get 429 at once (never queued);
  other bodies past ``max_json_body_bytes`` get 413; every body is read through a :class:`BodyGuard` that answers
  408 when it trickles in slower than ``body_min_rate_bytes_s`` (after ``body_grace_s``) or pauses longer than
  ``body_idle_timeout_s``. The guard raises inside the handler's read, so the store drops its temp file and
  nothing is published.

The request head's bounds (size, time) are the server's: :mod:`app.api.server.head_limits`.
"""

from __future__ import annotations

import logging
import time

import anyio
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import response_for
from app.config import Settings
from app.errors import KVGateError, PayloadTooLarge, RequestTimeout, TooManyRequests

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


def install(app: FastAPI, settings: Settings) -> None:
    app.add_middleware(LimitsMiddleware, settings=settings)
