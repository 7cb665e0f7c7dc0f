"""GET of a whole cached block, answered inside the HTTP protocol, its bytes sent by the kernel (``sendfile``).

Through the ASGI stack a block's GET reads the file into memory (a copy) and writes it to the socket (a second
copy), in a task, through the middlewares' send wrappers and Starlette's response; nginx sends a file with
``sendfile`` and copies nothing. The GET lane (wired into uvicorn's protocol by
:func:`app.api.server.lanes.with_lanes`) answers where the request head has just been parsed, synchronously, when
it can answer completely:

- a ``GET`` of ``/v1/blocks/<key>`` with no ``Range`` (a range needs its checksum: the stack's), no query, no
  body, no ``Expect``, no upgrade, no root path, no earlier request of the connection still being answered, under
  uvicorn's concurrency limit, over plain HTTP (TLS encrypts in user space: nothing to send from the file);
- the caller may read the key's namespace (:func:`app.api.middleware.auth.may_read`), the metadata cache holds the
  key's row, and the filesystem store opens that very version now, its pages in the page cache
  (``BlockService.open_now`` of the cached row: the same stamp check as the stack's reader, whose fd then pins
  the version);
- the block is at most :data:`MAX_BYTES`.

The answer is the stack's, byte for byte: uvicorn's default headers, the ETag and checksum lines, Content-Length,
Content-Type; the body goes from the file to the socket with ``sendfile`` for as much as the socket takes at once,
and whatever it does not take is read and handed to the transport as the stack would (its buffer, flow control).
It counts the hit and the access time as the stack's open does, and the request in the same metrics;
tests/api/test_get_lane.py compares the two on real servers. ``KVGATE_GET_LANE=false`` turns it off.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from app.api.middleware.auth import may_read
from app.api.middleware.metrics import RequestRecorder, Series, route_template
from app.api.middleware.principals import Principals
from app.api.routes.blocks import encoded_meta_headers
from app.api.server.put_lane import lane_service
from contract.keys import InvalidKey, block_namespace

MAX_BYTES = 4 * 1024 * 1024
"""The largest block the lane sends: what the socket does not take at once is held in memory until it does, as the
stack holds one read chunk of a slow reader's answer."""
_TYPE = b"content-type: application/octet-stream\r\n"


class ReadLane:
    """What the HEAD and GET lanes share: the route they answer for, and the checks before either answers (the
    core is up, the key's row is in the metadata cache, the caller may read its namespace)."""

    method = ""

    def __init__(self, *, state: Any, routes: list[Any], prefix: str, principals: Principals | None) -> None:
        self._state = state
        """The app's state: ``core`` once the lifespan has built it; ``request_recorder`` with metrics on."""
        self.prefix = prefix
        self._principals = principals
        self.reads_headers = principals is not None
        """Whether the scope it is given must carry the request's Authorization (auth is on)."""
        mine = [r for r in routes if self.method in (getattr(r, "methods", None) or ()) and r.path.startswith(prefix)]
        self.template = route_template(mine[0]) if mine else None
        self._service: Any = None
        self._series: Series | None = None
        """Where its answers (all 200) are counted, once metrics are up."""
        self.served = 0
        """Requests this lane answered (tests read it)."""

    def readable(self, path: str, scope: Any) -> tuple[Any, str, Any] | None:
        """(the service, the key, its cached row) when the caller may read ``path`` and its row is cached."""
        service = self._service or lane_service(self)
        if service is None or not path.startswith(self.prefix):
            return None
        key = path[len(self.prefix) :]
        meta = service.cached(key)  # only block keys are cached: a row found is a valid key's
        if meta is None:
            return None
        if self._principals is not None:  # auth is on (off, may_read allows all: the key's namespace is not parsed)
            try:
                namespace = block_namespace(key)
            except InvalidKey:
                return None
            if not may_read(self._principals, scope, namespace):
                return None
        return service, key, meta

    def _record(self, seconds: float, sent: int) -> None:
        series = self._series
        if series is None:  # looked up until found: the app's state is a Python __getattr__ per read
            recorder: RequestRecorder | None = getattr(self._state, "request_recorder", None)
            if recorder is None or self.template is None:
                return
            series = self._series = recorder.series(self.method, self.template, 200)
        series.add(seconds, 0, sent)


class GetLane(ReadLane):
    """Answers an allowed GET of a whole cached block: its head lines and an open descriptor of its file, or None
    (let the full stack answer)."""

    method = "GET"

    def answer(self, path: str, scope: Any) -> tuple[bytes, int, int] | None:
        """(the header lines after the status line and the server's default headers, the file's descriptor, its
        size) for ``GET path``; the caller sends the file and closes the descriptor."""
        found = self.readable(path, scope)
        if found is None:
            return None
        service, key, meta = found
        if meta.size > MAX_BYTES:
            return None
        fd = service.open_now(key, meta)
        if fd is None:
            return None
        self.served += 1
        lines = encoded_meta_headers(meta.digest, meta.size) + _TYPE
        return lines, fd, meta.size

    def record(self, seconds: float, size: int) -> None:
        self._record(seconds, size)


def send_file(transport: asyncio.Transport, fd: int, size: int) -> None:
    """Write the ``size`` bytes of the file open as ``fd`` after what ``transport`` was given before: by
    ``sendfile`` from the file to the socket while the socket takes them and nothing waits in the transport's
    buffer; the rest read and given to the transport."""
    sent = 0
    sock = transport.get_extra_info("socket")
    if sock is not None and transport.get_write_buffer_size() == 0:
        out = sock.fileno()
        try:
            while sent < size:
                n = os.sendfile(out, fd, sent, size - sent)
                if n == 0:
                    break  # the file ended early (it cannot: its version is pinned): the rest below says so
                sent += n
        except BlockingIOError:
            pass  # the socket's buffer is full: the transport takes the rest
        except OSError:
            transport.close()  # the peer is gone (reset, broken pipe)
            return
    try:
        while sent < size:
            rest = os.pread(fd, size - sent, sent)
            if not rest:
                break
            transport.write(rest)
            sent += len(rest)
    except OSError:
        pass
    if sent < size:
        transport.close()  # the file could not be read to its end: cut the answer short of its length, never pad it
