"""PUT of a small block, stored from inside the HTTP protocol: no ASGI cycle, no middleware chain, no Request, no
pydantic response.

A small PUT paid for the whole ASGI stack around ``BlockService.put``: uvicorn's cycle and its send, the metrics,
auth and limits middlewares' wrappers, the route's binding, a pydantic model for a four-field answer. The lane
(wired into uvicorn's protocol by :func:`app.api.server.lanes.with_lanes`) takes a PUT when, as its head is parsed:

- it is ``PUT /v1/blocks/<key>`` of a key that parses, with no query, no ``Expect``, no upgrade, no root path, no
  earlier request of the connection still being answered, under uvicorn's concurrency limit;
- it declares one ``Content-Length`` within :data:`MAX_BODY_BYTES`, no ``Transfer-Encoding``, none of a part's
  headers (a part goes to the stack), and its headers pass the route's own checks
  (:func:`app.api.routes.put_answer.read_put`, on the headers the route reads, ``PUT_HEADERS``, each at most
  once);
- the caller may write the key's namespace (:func:`app.api.middleware.auth.may_write`, the auth middleware's rule for
  this route), an upload slot is free (:class:`app.api.middleware.limits.UploadSlots`, shared with the stack) and
  the bodies the lane holds stay within :data:`HELD_BYTES` with this one;

and its whole body arrives within :data:`app.api.server.lanes.BODY_WAIT_S` of the read that ended its head (a
quarter of a second: the body rate and pause guards have nothing to judge in that time). Anything else, including
a body still coming at that deadline, goes down the usual stack exactly as uvicorn would have sent it, with the
bytes so far. The lane calls the route's own service call (``BlockService.put``) with the body's chunks as they
came, answers the route's bytes (uvicorn's default headers, then :func:`app.api.routes.put_answer.put_answer`'s:
ETag, Location, the JSON body), errors through the app's own exception handlers, and counts the request in the same
metrics. tests/api/test_put_lane.py compares it with the stack on real servers. ``KVGATE_PUT_LANE=false`` turns it off.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from app.api.middleware.auth import may_write
from app.api.middleware.limits import UploadSlots
from app.api.middleware.metrics import RequestRecorder, route_template
from app.api.middleware.principals import Principals
from app.api.routes.put_answer import PART_HEADERS, PUT_HEADERS, PutRequest, put_answer, read_put
from app.api.routes.thin import find_exception_handler
from app.core.values import BodyPieces
from app.errors import KVGateError
from contract import wire
from contract.keys import InvalidKey

log = logging.getLogger("uvicorn.error")  # where uvicorn logs an ASGI app's unhandled exception

_READ = {name.encode(): param for name, param in PUT_HEADERS.items() if name not in PART_HEADERS}
"""The headers of a whole block's PUT the lane reads (the route's: :data:`app.api.routes.put_answer.PUT_HEADERS`),
and the parameter of ``read_put`` each is."""
_STACK_ONLY = frozenset({b"transfer-encoding", *(name.encode() for name in PART_HEADERS)})
"""Headers that send a PUT to the stack: chunked bodies and parts."""
MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest body the lane collects: a Llama-8B-sized block of 16 tokens at TP=1 is 2 MiB, a rank's share at TP
2-8 256 KiB-1 MiB. Larger ones stream through the stack, whose reads the store's writes pace (flow control). At
2 MiB the lane costs less server CPU per PUT than the stack (``benchmarks.gateway.cost --ops put --sizes 2097152
--base``; docs/benchmarks.md, "Figures behind the code")."""
HELD_BYTES = 256 * 1024 * 1024
"""The most body bytes the lane holds at once, over all its PUTs (collecting or being stored): past it a PUT goes to
the stack, which reads as the store writes. Without it the bound would be ``max_uploads_in_flight`` (256) times
:data:`MAX_BODY_BYTES`."""


@dataclass(slots=True)
class LanePut:
    """A PUT the lane took, as its head was parsed."""

    request: PutRequest
    """What its headers say (``read_put``'s, as the route reads them)."""
    scope: Any
    """The request's ASGI scope (for an exception handler's Request)."""
    began: float

    @property
    def size(self) -> int:
        return self.request.size


@dataclass(slots=True)
class Answer:
    status: int
    lines: bytes
    """The header lines after the server's default headers."""
    body: bytes


class PutLane:
    """Takes a PUT of a whole block (:meth:`accept`) and stores it (:meth:`store`)."""

    def __init__(
        self, *, state: Any, app: Any, routes: list[Any], prefix: str, principals: Principals | None, max_bytes: int
    ) -> None:
        self._state = state
        """The app's state: ``core`` once the lifespan has built it, ``upload_slots``, ``request_recorder``."""
        self._app = app
        self.prefix = prefix
        self._principals = principals
        self._max_block_bytes = max_bytes
        self._max_bytes = min(max_bytes, MAX_BODY_BYTES)
        puts = [r for r in routes if "PUT" in (getattr(r, "methods", None) or ()) and r.path.startswith(prefix)]
        self.template = route_template(puts[0]) if puts else None
        self._service: Any = None
        self.served = 0
        """PUTs this lane stored or refused (tests read it)."""
        self.held = 0
        """Body bytes of the PUTs the lane has taken and not yet stored or handed over."""
        self.max_held = HELD_BYTES

    def accept(self, path: str, scope: Any, headers: list[tuple[bytes, bytes]], began: float) -> LanePut | None:
        """The PUT of ``path`` (its head just parsed) taken by the lane, holding an upload slot; None: the stack's."""
        service = self._service or lane_service(self)
        if service is None:
            return None
        slots: UploadSlots = self._state.upload_slots
        if slots.taken >= slots.max or not path.startswith(self.prefix):
            return None
        seen: dict[str, Any] = {}
        for name, value in headers:
            param = _READ.get(name)
            if param is not None:
                if param in seen:
                    return None  # repeated: the stack's binding decides
                seen[param] = value.decode("latin-1")
            elif name in _STACK_ONLY:
                return None
        length = seen.get("content_length")
        if length is None or not length.isdigit() or not length.isascii():
            return None
        size = seen["content_length"] = int(length)
        if size > self._max_bytes or self.held + size > self.max_held:
            return None
        try:
            taken = read_put(path[len(self.prefix) :], max_block_bytes=self._max_block_bytes, **seen)
        except (InvalidKey, wire.WireError, KVGateError):
            return None  # the stack answers the error
        if not may_write(self._principals, scope, taken.key.namespace):
            return None
        scope["method"], scope["path"], scope["raw_path"], scope["query_string"] = "PUT", path, path.encode(), b""
        slots.taken += 1
        self.held += size
        return LanePut(taken, scope, began)

    def release(self, put: LanePut) -> None:
        """Give back ``put``'s upload slot and its share of the held bytes (stored, or handed to the stack)."""
        self._state.upload_slots.taken -= 1
        self.held -= put.size

    async def store(self, put: LanePut, chunks: list[bytes]) -> Answer:
        """``BlockService.put`` of the body's chunks, answered as the route answers (its slot given back)."""
        try:
            try:
                request = put.request
                result = await self._service.put(
                    request.key,
                    BodyPieces(chunks),
                    size=request.size,
                    digest=request.digest,
                    create_only=request.create_only,
                    meta=request.meta,
                )
            except Exception as exc:
                return await self._error(put, exc)
        finally:
            self.release(put)
        answer = put_answer(result)
        return Answer(answer.status, _lines(answer.headers), answer.body)

    async def _error(self, put: LanePut, exc: Exception) -> Answer:
        """The app's exception handler's answer (the error table's JSON), or Starlette's 500 for an exception no
        handler takes, logged as uvicorn logs one."""
        handler = find_exception_handler(self._app, exc)
        response: Response
        if handler is None:
            log.error("Exception in ASGI application", exc_info=exc)
            response = PlainTextResponse("Internal Server Error", status_code=500)
        else:
            response = await handler(Request(put.scope), exc)
        return Answer(response.status_code, _lines(response.raw_headers), bytes(response.body))

    def record(self, put: LanePut, answer: Answer, seconds: float) -> None:
        self.served += 1
        recorder: RequestRecorder | None = getattr(self._state, "request_recorder", None)
        if recorder is not None and self.template is not None:
            recorder.record("PUT", self.template, answer.status, seconds, put.size, len(answer.body))


def lane_service(lane: Any) -> Any:
    """A lane's ``BlockService``, kept on ``lane._service`` once the app's lifespan has built the core; None before
    (and for a lane with no route to answer for: every request then goes to the stack)."""
    core = getattr(lane._state, "core", None)
    if core is None or lane.template is None:
        return None
    lane._service = core.service
    return core.service


def _lines(headers: list[tuple[bytes, bytes]]) -> bytes:
    return b"".join(name + b": " + value + b"\r\n" for name, value in headers)
