"""The stored batches, read back: ``GET /v1/events`` and the ZMQ replay socket, in any gateway process.

The publisher (app/events/publisher.py) stores every batch before it sends it, with its rows in order; the
newest ``events_buffer`` batches are kept. So a stream or a replay starts at any number still kept, after any
restart and on any replica; a number no longer kept is a gap (the subscriber resyncs with ``POST /v1/lookup``).
A stream wakes when the publisher in this process stores a round, else every ``poll_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from app.events.model import Batch, Event, event_of
from app.events.wire import EventCodec, EventEncodeError
from app.index import Index
from contract.keys import InvalidKey

log = logging.getLogger("kvgate.events")

READ_BATCHES = 256


class EventFeed:
    def __init__(self, *, index: Index, codec: EventCodec | None, poll_s: float, sync_s: float = 5.0) -> None:
        self._index = index
        self.codec = codec
        self._poll_s = poll_s
        self._sync_s = sync_s
        self._changed = asyncio.Event()
        self._closed = False

    def published(self) -> None:
        """The publisher in this process stored a round: wake the streams."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait(self, timeout_s: float) -> None:
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout_s)

    async def hello(self) -> tuple[int, int]:
        """``(first_seq, next_seq)``: the oldest number kept, and the number of the first batch after every change
        committed before this call (waits, at most ``sync_s``, until the publisher has covered them: a subscriber
        that starts there misses none of them, and one that saw a change acknowledged finds its event before)."""
        loop = asyncio.get_running_loop()
        head = await self._index.event_log.head()
        deadline = loop.time() + self._sync_s
        while True:
            state = await self._index.event_log.state()
            left = deadline - loop.time()
            if (state is not None and state.last_id >= head) or left <= 0 or self._closed:
                break
            await self._wait(min(self._poll_s, left))
        next_seq = state.next_seq if state is not None else 0
        first = await self._index.event_log.first_seq()
        return (next_seq if first is None else first), next_seq

    async def read(self, since: int, *, limit: int = READ_BATCHES) -> list[Batch]:
        """Stored batches from number ``since`` on, oldest first, with their events."""
        logged = await self._index.event_log.batches(since=since, limit=limit)
        if not logged:
            return []
        rows = await self._index.event_log.rows_by_id([i for b in logged for i in b.ids])
        out: list[Batch] = []
        for b in logged:
            events: list[Event] = []
            for i in b.ids:
                row = rows.get(i)
                if row is None:
                    continue  # unreachable: a batch's rows are trimmed only after it
                try:
                    events.append(event_of(row, self.codec))
                except (EventEncodeError, InvalidKey) as exc:  # the codec's settings changed since it went out
                    log.warning("replay: event of key=%s left out: %s", row.key[:600], exc)
            out.append(Batch(seq=b.seq, ts=b.ts, events=tuple(events), topic=b.topic))
        return out

    async def replay(self, first: int) -> AsyncIterator[Batch]:
        """Every batch kept from number ``first`` on, up to the newest stored when it gets there."""
        since = first
        while True:
            batches = await self.read(since)
            if not batches:
                return
            for batch in batches:
                yield batch
            since = batches[-1].seq + 1

    async def subscribe(self, *, since: int, heartbeat_s: float = 15.0) -> AsyncIterator[Batch | str]:
        """Batches numbered ``since`` or later, in order, as they are stored (a first number above the one asked for
        is a gap: those are no longer kept); a str notes a heartbeat or the end ("closed")."""
        cursor = since
        loop = asyncio.get_running_loop()
        quiet_since = loop.time()
        while not self._closed:
            batches = await self.read(cursor)
            if batches:
                for batch in batches:
                    yield batch
                cursor = batches[-1].seq + 1
                quiet_since = loop.time()
                continue
            if loop.time() - quiet_since >= heartbeat_s:
                yield "heartbeat"
                quiet_since = loop.time()
            await self._wait(min(self._poll_s, heartbeat_s))
        yield "closed"

    def end_streams(self) -> None:
        """End every stream (the server is stopping: it waits for open responses to end)."""
        self._closed = True
        self.published()
