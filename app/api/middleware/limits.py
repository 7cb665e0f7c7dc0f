"""Bounds on what one client can hold: uploads in flight, body sizes and rates, header size and time.

- :class:`LimitsMiddleware` (ASGI): PUTs of blocks past ``max_uploads_in_flight`` get 429 at once (never queued);
  other bodies past ``max_json_body_bytes`` get 413; every body is read through a :class:`BodyGuard` that answers
  408 when it trickles in slower than ``body_min_rate_bytes_s`` (after ``body_grace_s``) or pauses longer than
  ``body_idle_timeout_s``, counting only the time spent waiting for the client (never the gateway's own). The guard
  raises inside the handler's read, so the store drops its temp file and nothing is published.

The request head's bounds (size, time) are the server's: :mod:`app.api.server.head_limits`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.api.errors import response_for
from app.config import Settings
from app.errors import KVGateError, PayloadTooLarge, RequestTimeout, TooManyRequests
from contract import wire

log = logging.getLogger("kvgate.limits")

UPLOAD_PREFIX = "/v1/blocks/"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def _declared_length(scope: Scope) -> int | None:
    raw = _header(scope, b"content-length")
    if raw is None:
        return None
    try:
        return wire.parse_uint(raw.decode("latin-1"), what="Content-Length")
    except wire.MalformedHeader:
        return None  # the server's parser refuses it first; the body's size is bounded by the guard anyway


@dataclass(frozen=True, slots=True)
class BodyLimits:
    min_rate: float
    """Bytes a second a client must send, on average, once ``grace_s`` of its own time is spent."""
    grace_s: float
    idle_s: float
    """Longest pause inside a body."""

    @classmethod
    def of(cls, settings: Settings) -> BodyLimits:
        return cls(
            min_rate=settings.body_min_rate_bytes_s, grace_s=settings.body_grace_s, idle_s=settings.body_idle_timeout_s
        )


class BodyGuard:
    """The ``receive`` a handler reads its body through: minimum rate, longest pause, optional size bound.

    The clock is the client's: only the time spent waiting here for its bytes counts, from the handler's first
    read on. Time the gateway spends before it asks for the body (admission, index reads, a lock) or between two
    reads (writing what came) is its own, and never makes a client too slow. On a breach it sends the error
    response itself (``Connection: close``), then raises the error into the handler's read; whatever the handler
    answers afterwards is dropped by :meth:`send`.
    """

    def __init__(
        self, scope: Scope, receive: Receive, send: Send, *, limits: BodyLimits, max_bytes: int | None
    ) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._limits = limits
        self._max = max_bytes
        self._waited = 0.0
        """Seconds spent waiting for the client's bytes (in :meth:`receive`)."""
        self._received = 0
        self._done = False
        self.failure: KVGateError | None = None

    async def receive(self) -> Message:
        if self._done or self.failure is not None:
            return await self._receive()
        lim = self._limits
        allowed = min(lim.idle_s, lim.grace_s + self._received / lim.min_rate - self._waited)
        began = time.monotonic()
        try:
            async with asyncio.timeout(max(allowed, 0.0)):  # anyio.fail_after cost ~3x as much per body read
                message = await self._receive()
        except TimeoutError:
            self._waited += time.monotonic() - began
            raise await self._fail(
                RequestTimeout(f"request body too slow: {self._received} bytes in {self._waited:.1f}s of waiting")
            ) from None
        self._waited += time.monotonic() - began
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


class UploadSlots:
    """Block PUTs in flight, against ``max_uploads_in_flight``: one count for the stack (:class:`LimitsMiddleware`)
    and the PUT lane (app/api/server/put_lane.py). One event loop: plain numbers."""

    __slots__ = ("max", "taken")

    def __init__(self, max_uploads: int) -> None:
        self.max = max_uploads
        self.taken = 0

    def refusal(self) -> TooManyRequests | None:
        """The 429 a new upload gets now, or None when a slot is free."""
        if self.taken < self.max:
            return None
        return TooManyRequests(f"{self.taken} uploads in flight: the gateway takes at most {self.max}")


class LimitsMiddleware:
    def __init__(self, app: ASGIApp, *, settings: Settings, slots: UploadSlots) -> None:
        self.app = app
        self.max_json = settings.max_json_body_bytes
        self.body_limits = BodyLimits.of(settings)
        self.slots = slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        is_upload = scope["method"] == "PUT" and scope["path"].startswith(UPLOAD_PREFIX)
        length = _declared_length(scope)
        if not is_upload and length is not None and length > self.max_json:
            await response_for(PayloadTooLarge(f"request body over {self.max_json} bytes"))(scope, receive, send)
            return
        if is_upload and (refusal := self.slots.refusal()) is not None:
            await response_for(refusal)(scope, receive, send)
            return
        guard = BodyGuard(scope, receive, send, limits=self.body_limits, max_bytes=None if is_upload else self.max_json)
        if is_upload:
            self.slots.taken += 1
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            if guard.failure is None:
                raise
        finally:
            if is_upload:
                self.slots.taken -= 1


def install(app: FastAPI, settings: Settings) -> None:
    """The middleware, and its upload slots as ``app.state.upload_slots`` (the PUT lane takes from the same)."""
    slots = app.state.upload_slots = UploadSlots(settings.max_uploads_in_flight)
    app.add_middleware(LimitsMiddleware, settings=settings, slots=slots)
