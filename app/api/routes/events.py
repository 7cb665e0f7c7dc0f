"""GET /v1/events: the gateway's KV events as server-sent events (JSON), for people and scripts.

Each batch is one SSE message: ``id`` is its sequence number, ``data`` its JSON (``{"seq", "ts", "events"}``).
The first message (``event: hello``) gives ``first_seq``, where this gateway process started numbering (a new
value means a restart), and ``next_seq``. ``event: gap`` says batches asked for are no longer (or never were) held:
resync. ``event: overflow`` ends a stream that fell too far behind: reconnect with ``since``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from app.api.errors import documented
from app.core.events import EventBus
from app.errors import EventsDisabled
from contract import wire
from contract.keys import parse_namespace

router = APIRouter(prefix="/v1", tags=["events"])

SEQ_PATTERN = "^[0-9]{1,18}$"
"""A sequence number as the query takes it (ASCII digits, below 2**63): contract.wire.parse_uint's grammar."""


def _message(event: str, data: object, *, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    return f"{head}event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


@router.get(
    "/events",
    summary="KV events of committed changes, as server-sent events",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}, **documented(400, 404)},
)
async def events(
    request: Request,
    since: Annotated[
        str | None, Query(pattern=SEQ_PATTERN, description="first sequence number wanted (from the ring)")
    ] = None,
    namespace: Annotated[str | None, Query(max_length=512, description="only this namespace's events")] = None,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", description="the last sequence number seen: resume after it")
    ] = None,
) -> StreamingResponse:
    bus: EventBus | None = getattr(request.app.state, "events", None)
    if bus is None:
        raise EventsDisabled("KV events are off (KVGATE_EVENTS_ENABLED=true turns them on)")
    first = None if since is None else wire.parse_uint(since, what="since")
    if first is None and last_event_id is not None:
        first = wire.parse_uint(last_event_id, what="Last-Event-ID") + 1
    if namespace is not None:
        parse_namespace(namespace)  # InvalidKey: a 400

    async def stream() -> AsyncIterator[bytes]:
        start = bus.next_seq  # without since: from the hello on (a batch sent while it goes out is replayed)
        yield _message("hello", {"first_seq": bus.first_seq, "next_seq": start})
        async for item in bus.subscribe(since=start if first is None else first):
            if isinstance(item, str):
                if item == "heartbeat":
                    yield b": heartbeat\n\n"
                    continue
                yield _message(item, {"next_seq": bus.next_seq})
                if item in ("overflow", "closed"):
                    return
                continue
            data = item.as_json(namespace)
            if data is not None:
                yield _message("batch", data, seq=item.seq)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
