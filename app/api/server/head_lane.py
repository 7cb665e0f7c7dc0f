"""HEAD of a cached block, answered inside the HTTP protocol: no ASGI task, no middleware chain, no Response object.

``HEAD /v1/blocks/{path}`` is the request a connector makes for every block it might load and a router for every
prefix it scores; the answer is a few header lines from the metadata cache. Through the ASGI stack it cost ~3x
nginx's CPU (``benchmarks.cost``), most of it the stack itself: uvicorn's task and cycle per request, the
middlewares' send wrappers, Starlette's Request and Response (``benchmarks.http_floor``: a bare ASGI app on the
same server already costs 1.5x nginx per HEAD). :func:`with_head_lane` answers it where the request head has just
been parsed, synchronously, when it can answer completely:

- a ``HEAD`` of ``/v1/blocks/<key>``, no query, no body, no ``Expect``, no upgrade, no root path configured;
- no earlier request of the connection still being answered (pipelining keeps its order), under uvicorn's
  concurrency limit;
- the key parses, the caller may read its namespace (:func:`app.api.middleware.auth.may_read`, the rule the auth
  middleware applies to this route), and the metadata cache holds the key's row (as ``BlockService.head`` would
  serve it: the same epoch checks).

Anything else goes down the usual stack unchanged: a miss, an uncached row, a bad key, a refused caller get the
answers (and logs) they always had. The answer is byte for byte the full stack's (uvicorn's default headers, the
ETag and checksum lines, ``Connection: close`` where the connection ends), counted in the same request metrics and
hit counter; tests/api/test_head_lane.py compares the two on a real server. ``KVGATE_HEAD_LANE=false`` turns it off.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.api.middleware.auth import may_read
from app.api.middleware.metrics import RequestRecorder, route_template
from app.api.middleware.principals import Principals
from app.api.routes.blocks import encoded_meta_headers
from contract.keys import InvalidKey, block_namespace

_OK = STATUS_LINE[200]
_BODY_HEADERS = frozenset({b"content-length", b"transfer-encoding"})


class HeadLane:
    """Answers an allowed HEAD of a cached block: the head's bytes, or None (let the full stack answer)."""

    def __init__(self, *, state: Any, routes: list[Any], prefix: str, principals: Principals | None) -> None:
        self._state = state
        """The app's state: ``core`` once the lifespan has built it; ``request_recorder`` with metrics on."""
        self.prefix = prefix
        self._principals = principals
        heads = [r for r in routes if "HEAD" in (getattr(r, "methods", None) or ()) and r.path.startswith(prefix)]
        self.template = route_template(heads[0]) if heads else None
        self._service: Any = None
        self.served = 0
        """HEADs this lane answered (tests read it)."""

    def answer(self, path: str, scope: Any) -> bytes | None:
        """The header lines after the status line and the server's default headers, for ``HEAD path``."""
        service = self._service
        if service is None:
            core = getattr(self._state, "core", None)  # built by the lifespan
            if core is None or self.template is None:
                return None
            service = self._service = core.service
        if not path.startswith(self.prefix):
            return None
        key = path[len(self.prefix) :]
        meta = service.cached(key)  # only block keys are cached: a row found is a valid key's
        if meta is None:
            return None
        try:
            namespace = block_namespace(key)
        except InvalidKey:
            return None
        if not may_read(self._principals, scope, namespace):
            return None
        service.counters.hits += 1
        self.served += 1
        return encoded_meta_headers(meta.digest) + b"content-length: %d\r\n" % meta.size

    def record(self, seconds: float) -> None:
        recorder: RequestRecorder | None = getattr(self._state, "request_recorder", None)
        if recorder is not None and self.template is not None:
            recorder.record("HEAD", self.template, 200, seconds, 0, 0)


class _NoEvent:
    __slots__ = ()

    def set(self) -> None:
        pass


class _Answered:
    """Stands in for uvicorn's cycle of a request the lane answered: complete, nothing waits on it."""

    __slots__ = ()
    response_complete = True
    disconnected = False
    keep_alive = True
    more_body = False
    body = b""
    message_event = _NoEvent()


ANSWERED: Any = _Answered()


def with_head_lane(base: type[HttpToolsProtocol], lane: HeadLane) -> type[HttpToolsProtocol]:
    """``base`` (uvicorn 0.55's httptools protocol or a subclass; pinned in pyproject.toml) answering what ``lane``
    can answer as soon as a request's head is parsed. Put it under the protocols that bound the head (their
    ``on_headers_complete`` runs first and calls this one)."""

    parent: Any = base  # a class chosen at run time: its attributes are uvicorn's protocol's

    class HeadLaneProtocol(parent):  # type: ignore[misc]
        cycle: Any  # uvicorn's (annotations only: no class attribute)
        head_lane = lane
        _lane_answered = False
        _idle_at: float | None = None
        """When the connection, idle after the lane's answer, is to be closed (uvicorn's keep-alive timeout)."""
        _idle_timer: asyncio.TimerHandle | None = None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._lane_answered:
                self._lane_answered = False
                # as uvicorn's on_response_complete: the keep-alive deadline of the idle connection, once nothing
                # is in flight after this read (a request parsed after the lane's answer may have started)
                if self.cycle is ANSWERED and not self.transport.is_closing() and not self.pipeline:
                    self._idle()

        # The keep-alive deadline after the lane's answers is a number; its timer is made once and re-arms itself
        # when it fires early (a timer made and cancelled per request cost as much as the answer's lookup).
        # uvicorn's own timer (after an answer of the stack) is untouched.

        def _idle(self) -> None:
            self._idle_at = self.loop.time() + self.timeout_keep_alive
            if self._idle_timer is None:
                self._idle_timer = self.loop.call_at(self._idle_at, self._idle_expired)

        def _idle_expired(self) -> None:
            self._idle_timer = None
            at = self._idle_at
            if at is None:
                return  # busy since, or answered by the stack (whose keep-alive timer is uvicorn's)
            if self.loop.time() < at:
                self._idle_timer = self.loop.call_at(at, self._idle_expired)
                return
            self._idle_at = None
            self.timeout_keep_alive_handler()

        def _unset_keepalive_if_required(self) -> None:
            self._idle_at = None
            super()._unset_keepalive_if_required()

        def connection_lost(self, exc: Exception | None) -> None:
            self._idle_at = None
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
            super().connection_lost(exc)

        def on_headers_complete(self) -> None:
            if self.cycle is ANSWERED and self.transport.is_closing():
                return  # the lane answered with Connection: close: what follows on the connection is dropped
            if not self._lane(time.perf_counter()):
                super().on_headers_complete()

        def _lane(self, began: float) -> bool:
            parser = self.parser
            if parser.get_method() != b"HEAD" or self.root_path or self.expect_100_continue:
                return False
            cycle = self.cycle
            if (cycle is not None and not cycle.response_complete) or self.pipeline or parser.should_upgrade():
                return False
            limit = self.limit_concurrency
            if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
                return False  # uvicorn answers its 503
            for name, _ in self.headers:
                if name in _BODY_HEADERS:
                    return False
            url = httptools.parse_url(self.url)
            if url.query is not None:
                return False
            path = url.path.decode("ascii")
            if "%" in path:
                path = unquote(path)
            lines = lane.answer(path, self.scope)
            if lines is None:
                return False
            keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
            head = [_OK]
            for name, value in self.server_state.default_headers:
                head += (name, b": ", value, b"\r\n")
            head.append(lines)
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            self.cycle = ANSWERED
            self.transport.write(b"".join(head))
            self.server_state.total_requests += 1
            if keep_alive:
                self._lane_answered = True
            else:
                self.transport.close()
            lane.record(time.perf_counter() - began)
            return True

    HeadLaneProtocol.__name__ = f"HeadLane{base.__name__}"
    return HeadLaneProtocol
