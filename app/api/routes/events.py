"""GET /v1/events: the gateway's KV events as server-sent events (JSON), for people and scripts.

Each batch is one SSE message: ``id`` is its sequence number, ``data`` its JSON (``{"seq", "ts", "events"}``).
The first message (``event: hello``) gives ``first_seq``, the oldest number still kept, and ``next_seq``, the
number of the first batch after every change committed before the request (without ``since`` the stream starts
there). The batches are read from the index (app/events/feed.py), so any gateway process or replica serves the
same stream, across restarts. ``event: gap`` says batches asked for are no longer kept (``next_seq``: where the
stream goes on): resync.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import StreamingResponse

from app.api.errors import documented
from app.errors import EventsDisabled
from app.events.feed import EventFeed
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
        str | None, Query(pattern=SEQ_PATTERN, description="first sequence number wanted (of those kept)")
    ] = None,
    namespace: Annotated[str | None, Query(max_length=512, description="only this namespace's events")] = None,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", description="the last sequence number seen: resume after it")
    ] = None,
) -> StreamingResponse:
    feed: EventFeed | None = getattr(request.app.state, "events", None)
    if feed is None:
        raise EventsDisabled("KV events are off (KVGATE_EVENTS_ENABLED=true turns them on)")
    first = None if since is None else wire.parse_uint(since, what="since")
    if last_event_id is not None:  # read even where ``since`` wins: a malformed one is a 400 either way
        resume = wire.parse_uint(last_event_id, what="Last-Event-ID") + 1
        first = resume if first is None else first
    if namespace is not None:
        parse_namespace(namespace)  # InvalidKey: a 400

    async def stream() -> AsyncIterator[bytes]:
        first_seq, next_seq = await feed.hello()
        yield _message("hello", {"first_seq": first_seq, "next_seq": next_seq})
        cursor = next_seq if first is None else first
        async for item in feed.subscribe(since=cursor):
            if isinstance(item, str):
                if item == "heartbeat":
                    yield b": heartbeat\n\n"
                    continue
                yield _message(item, {"next_seq": cursor})  # closed: the server is stopping
                return
            if item.seq > cursor:  # batches asked for are no longer kept
                yield _message("gap", {"next_seq": item.seq})
            cursor = item.seq + 1
            data = item.as_json(namespace)
            if data is not None:
                yield _message("batch", data, seq=item.seq)

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)
