"""The lanes: requests of the data path answered inside the HTTP protocol, past the ASGI stack.

:func:`with_lanes` wires three into uvicorn's protocol: the HEAD lane (:class:`HeadLane`, below), the GET lane
(app/api/server/get_lane.py: a whole cached block, sent with ``sendfile``) and the PUT lane
(app/api/server/put_lane.py: a small block's PUT whose body is all here within a moment of its head). Each takes
only what it can answer completely and as the stack would; everything else goes down the stack unchanged.

HEAD of a cached block, answered inside the HTTP protocol: no ASGI task, no middleware chain, no Response object.

``HEAD /v1/blocks/{path}`` is the request a connector makes for every block it might load and a router for every prefix
it scores; the answer is a few header lines from the metadata cache. Through the ASGI stack it cost several times
nginx's CPU (``benchmarks.gateway.cost``), most of it the stack itself: uvicorn's task and cycle per request, the
middlewares' send wrappers, Starlette's Request and Response (``benchmarks.primitives.http_floor``: a bare ASGI app on
the same server already costs more than nginx per HEAD; figures: docs/benchmarks.md). :func:`with_lanes` answers it
where the request head has just been parsed, synchronously, when it can answer completely:

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

Even past the stack, most of such a HEAD's CPU went to the parse: httptools' callbacks into uvicorn (a scope dict
per request, a call per header line), the head bounds' sums. So a read that is one whole, plain HEAD of a block and
nothing else (:func:`head_lexer`: conservative, anything unusual is the parser's) is answered before the parser sees
it, under the same checks and with the same bytes, when the parser is between two requests (a read that ends a head
begun earlier is the parser's whatever it holds: taken for a request of its own, a header line split across reads
would smuggle one).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from typing import Any
from urllib.parse import unquote

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from app.api.routes.blocks import encoded_meta_headers
from app.api.server.get_lane import GetLane, ReadLane, send_file
from app.api.server.http_body import BodyChunks
from app.api.server.put_lane import LanePut, PutLane

_OK = STATUS_LINE[200]
_BODY_HEADERS = frozenset({b"content-length", b"transfer-encoding"})


def head_lexer(prefix: str) -> re.Pattern[bytes]:
    """The one request head the HEAD lane answers before the parser sees it: ``HEAD <prefix><key> HTTP/1.1``, a key
    of the block keys' characters (no ``%``, no query), token-named header lines of printable ASCII (no obs-fold,
    no bare LF, no NUL or other control but HTAB), none that declares a body, expects, or speaks of the connection
    (an upgrade needs a Connection line too), and the blank line last: a whole, lone request (its one CRLFCRLF at its
    end). Group 1: the path."""
    return re.compile(
        b"HEAD (" + re.escape(prefix.encode("ascii")) + rb"[A-Za-z0-9._/-]+) HTTP/1\.1\r\n"
        rb"(?:(?!(?i:content-length|transfer-encoding|expect|connection):)"
        rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+:[\t\x20-\x7e]*\r\n)*\r\n"
    )


_AUTHORIZATION = re.compile(rb"\r\n(?i:authorization):[ \t]*([\t\x20-\x7e]*?)[ \t]*\r\n")
"""The first Authorization line of a head :func:`head_lexer` took, its value as uvicorn's scope has it (llhttp
drops the leading blanks, uvicorn the trailing ones)."""
_NO_HEADERS: Any = {"headers": ()}


class HeadLane(ReadLane):
    """Answers an allowed HEAD of a cached block: the head's bytes, or None (let the full stack answer)."""

    method = "HEAD"
    prelexed = 0
    """Of those served, the ones answered before the parser saw them (tests read it)."""

    def answer(self, path: str, scope: Any) -> bytes | None:
        """The header lines after the status line and the server's default headers, for ``HEAD path``."""
        found = self.readable(path, scope)
        if found is None:
            return None
        service, _, meta = found
        service.counters.hits += 1
        self.served += 1
        return encoded_meta_headers(meta.digest, meta.size)

    def record(self, seconds: float) -> None:
        self._record(seconds, 0)


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


BODY_WAIT_S = 0.25
"""How long the PUT lane waits for the rest of a body after the read that ended its head; then the stack reads it,
under its body guards (rate, pauses: app/api/middleware/limits.py), which count only the time they wait."""


class _LaneCycle:
    """Stands in for uvicorn's cycle of a PUT the lane took: collecting its body (``collecting``), then being stored
    (not complete: a request pipelined behind it waits in uvicorn's pipeline), then answered."""

    __slots__ = ("body", "collecting", "disconnected", "keep_alive", "previous", "put", "response_complete", "wait")
    message_event = _NoEvent()
    more_body = True

    def __init__(self, previous: Any, put: LanePut, keep_alive: bool) -> None:
        self.previous = previous
        """The connection's cycle before this request (restored when the request goes to the stack), dropped once
        the body is all here: kept, each of a connection's cycles would hold the one before it, and its body."""
        self.put = put
        self.body = BodyChunks()
        self.collecting = True
        self.response_complete = False
        self.disconnected = False
        self.keep_alive = keep_alive
        """Cleared by uvicorn's shutdown(): the answer then closes the connection."""
        self.wait: asyncio.TimerHandle | None = None
        """Armed when a read ends before the body does: at :data:`BODY_WAIT_S` the stack takes the request."""

    def stop_collecting(self) -> None:
        self.collecting = False
        if self.wait is not None:
            self.wait.cancel()
            self.wait = None


class LanesProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol (0.55, pinned in pyproject.toml) answering what the lanes can answer as soon as a
    request's head is parsed. Configured by :func:`with_lanes`, which puts it above a protocol class (a subclass of
    uvicorn's) with its lanes as class attributes: uvicorn makes a protocol per connection from the class alone."""

    cycle: Any  # uvicorn's (annotations only: no class attribute)
    head_lane: HeadLane | None = None
    put_lane: PutLane | None = None
    get_lane: GetLane | None = None
    """The lanes (None: turned off)."""
    lexer: re.Pattern[bytes] | None = None
    """The HEAD lane's :func:`head_lexer`."""
    _joined: list[Any] = [None, b""]
    """uvicorn's default headers and their lines (:meth:`_head`), one pair per class :func:`with_lanes` makes."""
    head_too_large = False
    """Set by the head bounds while the stack answers 431: no lane takes the request."""
    _lane_answered = False
    _at_boundary = True
    """The parser is between two requests (none begun): only then may a read be taken for a whole request."""
    max_header_bytes = 64 * 1024
    """The head bounds' limit (theirs where they are above): a longer read is never the HEAD lane's."""
    _idle_at: float | None = None
    """When the connection, idle after a lane's answer, is to be closed (uvicorn's keep-alive timeout)."""
    _idle_timer: asyncio.TimerHandle | None = None

    def data_received(self, data: bytes) -> None:
        if self._at_boundary and self.head_lane is not None and data[:5] == b"HEAD " and self._prelexed(data):
            return
        super().data_received(data)
        cycle = self.cycle
        if type(cycle) is _LaneCycle and cycle.collecting and cycle.wait is None:
            # the body is still coming: a short wait for it, then the stack reads it, with its guards
            cycle.wait = self.loop.call_later(BODY_WAIT_S, self._body_late, cycle)
        if self._lane_answered:
            self._lane_answered = False
            # as uvicorn's on_response_complete: the keep-alive deadline of the idle connection, once nothing
            # is in flight after this read (a request parsed after the lane's answer may have started)
            if self.cycle is ANSWERED and not self.transport.is_closing() and not self.pipeline:
                self._idle()

    # The keep-alive deadline after the lanes' answers is a number; its timer is made once and re-arms itself
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
        cycle = self.cycle
        if type(cycle) is _LaneCycle and cycle.collecting:
            cycle.stop_collecting()  # gone before its body was all here: nothing stored, its slot back
            assert self.put_lane is not None
            self.put_lane.release(cycle.put)
        self._idle_at = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        if self.cycle is ANSWERED and self.transport.is_closing():
            return  # the lane answered with Connection: close: what follows on the connection is dropped
        if self.head_too_large or not self._lane(time.perf_counter()):
            super().on_headers_complete()

    def on_message_begin(self) -> None:
        self._at_boundary = False
        super().on_message_begin()

    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        if type(cycle) is _LaneCycle and cycle.collecting:
            cycle.body += body
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._at_boundary = True  # an upgrade's too: httptools resumes its parser after it
        cycle = self.cycle
        if type(cycle) is _LaneCycle and cycle.collecting:
            cycle.stop_collecting()
            cycle.previous = None  # the body is all here: the request is the lane's to the end
            task = self.loop.create_task(self._store(cycle))
            task.add_done_callback(self.tasks.discard)
            self.tasks.add(task)  # uvicorn's concurrency limit and graceful shutdown count it
        else:
            super().on_message_complete()

    def _lane(self, began: float) -> bool:
        parser = self.parser
        method = parser.get_method()
        if method == b"HEAD":
            lane: Any = self.head_lane
        elif method == b"GET":
            lane = self.get_lane
        elif method == b"PUT":
            lane = self.put_lane
        else:
            return False
        if lane is None or self.root_path or self.expect_100_continue:
            return False
        cycle = self.cycle
        if (cycle is not None and not cycle.response_complete) or self.pipeline or parser.should_upgrade():
            return False
        if self.flow.write_paused:
            return False  # the client is not reading what it was sent: the stack's answers wait for it, in turn
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return False  # uvicorn answers its 503
        url = httptools.parse_url(self.url)
        if url.query is not None:
            return False
        path = url.path.decode("ascii")
        if "%" in path:
            path = unquote(path)
        keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
        if lane is self.put_lane:
            taken = lane.accept(path, self.scope, self.headers, began)
            if taken is None:
                return False
            self.cycle = _LaneCycle(cycle, taken, keep_alive)
            return True
        for name, _ in self.headers:
            if name in _BODY_HEADERS or (name == b"range" and lane is self.get_lane):
                return False
        if lane is self.get_lane:
            got = lane.answer(path, self.scope)
            if got is None:
                return False
            lines, fd, size = got
            try:
                self.cycle = ANSWERED
                self.transport.write(self._head(_OK, lines, keep_alive))
                send_file(self.transport, fd, size)
            finally:
                os.close(fd)
            self._answered(keep_alive)
            lane.record(time.perf_counter() - began, size)
            return True
        lines = lane.answer(path, self.scope)
        if lines is None:
            return False
        self.cycle = ANSWERED
        self.transport.write(self._head(_OK, lines, keep_alive))
        self._answered(keep_alive)
        lane.record(time.perf_counter() - began)
        return True

    def _prelexed(self, data: bytes) -> bool:
        """Answer ``data``, a read with a whole ``HEAD`` of a block and nothing else, before the parser sees it
        (the parser's callbacks, uvicorn's scope, the head bounds' sums were most of the CPU of a lane's HEAD);
        False (nothing done: the parser takes the read) for anything :func:`head_lexer` does not take, or any
        request the lane would leave to the stack. Called only at a request boundary: a read that ends a head
        begun in an earlier read is the parser's, whatever it looks like."""
        began = time.perf_counter()
        head, lexer = self.head_lane, self.lexer
        assert head is not None and lexer is not None
        if len(data) > self.max_header_bytes or self.root_path:
            return False  # the bounds' 431; under a root path auth reads the path without it
        # _lane's checks that need no parser, written out again: a call to a shared helper showed on this path
        cycle = self.cycle  # the last request parsed: not complete while any waits in uvicorn's pipeline
        if (cycle is not None and not cycle.response_complete) or self.flow.write_paused:
            return False
        limit = self.limit_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            return False
        found = lexer.fullmatch(data)
        if found is None:
            return False
        scope = _NO_HEADERS
        if head.reads_headers:  # who the caller is: identify() reads the Authorization line (or a TLS peer's
            # certificate, not in this scope: such a caller is the parser's, whose scope has it)
            auth = _AUTHORIZATION.search(data)
            scope = {"headers": [(b"authorization", auth[1])] if auth is not None else []}
        lines = head.answer(found[1].decode("ascii"), scope)
        if lines is None:
            return False
        # as uvicorn's data_received, the head bounds' and on_headers_complete, then _answered and data_received
        # with a lane's answer: keep-alive (no Connection line), idle once written
        self._unset_keepalive_if_required()
        self._head_read()
        self.cycle = ANSWERED
        self.transport.write(self._head(_OK, lines, True))
        self.server_state.total_requests += 1
        self._idle()
        head.prelexed += 1
        head.record(time.perf_counter() - began)
        return True

    def _head_read(self) -> None:
        """A whole head was read and answered without the parser (the head bounds above reset their count)."""

    def _answered(self, keep_alive: bool) -> None:
        """A lane's whole answer is written: counted, and the connection kept for the next request or closed."""
        self.server_state.total_requests += 1
        if keep_alive:
            self._lane_answered = True
        else:
            self.transport.close()

    def _head(self, status_line: bytes, lines: bytes, keep_alive: bool) -> bytes:
        defaults = self.server_state.default_headers
        if defaults is not self._joined[0]:
            # uvicorn's default headers, joined once per list: it makes a new one each second (the date); the
            # one kept here cannot be freed, so no new list can be it
            self._joined[:] = defaults, b"".join(b"%s: %s\r\n" % header for header in defaults)
        close = b"" if keep_alive else b"connection: close\r\n"
        return b"".join((status_line, self._joined[1], lines, close, b"\r\n"))

    def _body_late(self, cycle: _LaneCycle) -> None:
        if self.cycle is cycle and cycle.collecting:
            self._to_stack(cycle)

    def _to_stack(self, cycle: _LaneCycle) -> None:
        """Hand a PUT whose body is not all here to the stack, as uvicorn would have when its head was parsed,
        with the body's chunks so far."""
        put = self.put_lane
        assert put is not None
        cycle.stop_collecting()
        put.release(cycle.put)
        self.cycle = cycle.previous
        if self.transport.is_closing():
            return  # a parse error answered 400 and closed the connection
        super().on_headers_complete()  # uvicorn's: the head bounds were checked before the lane took it
        if len(cycle.body):
            self.cycle.body = cycle.body
            if len(cycle.body) > HIGH_WATER_LIMIT:
                self.flow.pause_reading()
            self.cycle.message_event.set()

    async def _store(self, cycle: _LaneCycle) -> None:
        put = self.put_lane
        assert put is not None
        taken = cycle.put
        answer = await put.store(taken, cycle.body.chunks())
        cycle.body = BodyChunks()  # stored: the cycle stays the connection's until its next request, not its bytes
        cycle.response_complete = True
        put.record(taken, answer, time.perf_counter() - taken.began)
        transport = self.transport
        if transport.is_closing():
            return  # the client went away: stored all the same, as the stack's handler would have
        keep_alive = cycle.keep_alive
        transport.write(self._head(STATUS_LINE[answer.status], answer.lines, keep_alive) + answer.body)
        self.server_state.total_requests += 1
        if not keep_alive:
            transport.close()
            return
        # as uvicorn's on_response_complete, with the lanes' keep-alive deadline
        self._unset_keepalive_if_required()
        self.flow.resume_reading()
        if self.pipeline:
            next_cycle, app = self.pipeline.pop()
            self._start_asgi_task(next_cycle, app)
        else:
            self._idle()


def with_lanes(
    base: type[HttpToolsProtocol], *, head: HeadLane | None, put: PutLane | None, get: GetLane | None = None
) -> type[HttpToolsProtocol]:
    """:class:`LanesProtocol` above ``base`` (uvicorn 0.55's httptools protocol or a subclass; pinned in
    pyproject.toml), with its lanes (``head``, ``put``, ``get``: None for a lane turned off). Put it under the
    protocols that bound the head (their ``on_headers_complete`` runs first and calls this one; an oversized head,
    which they answer 431 through the stack, is never a lane's)."""
    lanes = {
        "head_lane": head,
        "put_lane": put,
        "get_lane": get,
        "lexer": head_lexer(head.prefix) if head is not None else None,
        "_joined": [None, b""],
    }
    return type(f"Lanes{base.__name__}", (LanesProtocol, base), lanes)
