"""The one publisher of a deployment's KV events: it tails the event log (app/index/eventlog.py), numbers batches,
stores them, and sends them.

Every gateway process with events on stands as a candidate (``PublisherRole``); one at a time publishes: on one
machine the holder of the coordination file's ``events`` lock, across machines (PostgreSQL) the holder of an
advisory lock as well. The others stand by and take over when it dies (the kernel drops a dead process's file lock,
PostgreSQL a dead session's advisory lock). The publisher binds the ZMQ sockets, takes a new term in the index, and
runs rounds (``Publisher.round``):

1. read the log rows after the last one covered, up to the horizon below which every row is final (``Horizon``);
   encode each on its own (a row the codec refuses is dropped alone and takes no number);
2. order: a row that waits for PUTs of its parent (in progress where it committed) is held until their rows come
   (``ParentFirst``, fed with the log), each key's rows keep the log's order; a wait longer than ``events_hold_s``
   (the writer died) ends;
3. group what is ready into batches by topic (parents first within each; across topics a round goes topic by
   topic, not in commit order), number them from the stored next number, and store them with the new next number,
   the last row covered and the rows still held (with the PUTs they wait for), in one transaction that only commits
   if the term is still this publisher's;
4. send them (ZMQ PUB) and wake the local SSE streams.

Any failure before 3 commits leaves nothing: the round is read again (``resume``: a new term, the state as stored).
A publisher that dies between 3 and 4 leaves batches stored and unsent: subscribers see the next number jump, and
the replay socket, served from the stored batches, fills it. So numbers never go back and are never reused, and a
restart, a failover or a standby's takeover resumes where the last stored round stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from app.core.coordination import Coordinator
from app.errors import IndexUnavailable
from app.events.model import Batch, BatchSink, Event, event_of
from app.events.order import ParentFirst, parents_first
from app.events.wire import EventCodec, EventEncodeError, ModelNames, Topics
from app.index import Index
from app.index.eventlog import CONFIG_REMOVED, RELEASE, Horizon, LoggedBatch, LogRow
from contract.keys import InvalidKey
from contract.wire import MalformedHeader

log = logging.getLogger("kvgate.events")

ROWS_PER_ROUND = 5000
EVENTS_PER_BATCH = 1024
MAX_HELD = 10_000
"""Past this many rows held for their parents, new ones go out at once (order best effort, state bounded)."""
TRIM_EVERY = 64
"""Rounds between trims of the stored batches and the log."""
ROUND_GAP_S = 0.02
"""After a round that published, the next waits this long: under load a round takes what many commits wrote (one
read, one transaction for all of them), at the cost of at most this much delay."""


class LostTurn(RuntimeError):
    """Another publisher took over (a later term is stored)."""


class Publisher:
    """One publisher's rounds (see the module doc); ``resume`` before the first."""

    def __init__(
        self,
        *,
        index: Index,
        codec: EventCodec | None = None,
        topics: Topics | None = None,
        models: ModelNames | None = None,
        sinks: Sequence[BatchSink] = (),
        keep: int = 10_000,
        hold_s: float = 60.0,
        published: Callable[[], None] = lambda: None,
    ) -> None:
        self._index = index
        self.codec = codec
        self.topics = topics
        self.models = models
        self._sinks = tuple(sinks)
        self._keep = keep
        self._hold_s = hold_s
        self._published = published
        self._horizon = Horizon()
        self._order: ParentFirst[Event] = ParentFirst(max_held=MAX_HELD)
        self._tokens: dict[int, str] = {}
        """Token of each PUT that held rows wait for -> its key."""
        self._since: dict[int, float] = {}
        """Token -> since when (monotonic) rows wait for it."""
        self._ready: list[Event] = []
        self._term = 0
        self._next_seq = 0
        self._last_id = 0
        self._rounds = 0
        self.published = 0
        """Events published."""
        self.dropped = 0
        """Rows the codec refused (each dropped alone)."""
        self.behind = False
        """The last round read as many rows as a round takes: more may be there."""

    @property
    def next_seq(self) -> int:
        return self._next_seq

    async def resume(self) -> None:
        """Take a new term and start from the stored state (the rows it held are read again and held again, for the
        rows they still await)."""
        state = await self._index.event_log.claim()
        self._term, self._next_seq, self._last_id = state.term, state.next_seq, state.last_id
        self._order = ParentFirst(max_held=MAX_HELD)
        self._ready = []
        self._tokens = dict(state.waiting)
        self._since = dict.fromkeys(self._tokens, time.monotonic())
        for key in self._tokens.values():
            self._order.begin(key)
        models = self.models
        if models is not None and self.topics is not None and self.topics.needs_model:
            # Every configured namespace's model name, now: a row is encoded after its change committed, and a purge
            # removes the config right after its blocks' rows, so a publisher that first met the namespace in those
            # rows found no config and sent them under another topic (the router kept the blocks).
            await models.load(n for n in await self._index.scans.namespace_names() if not models.known(n))
        if state.held:  # parents first: a child held behind its parent, itself held, has the smaller id
            rows = await self._index.event_log.rows_by_id(state.held)
            events = [e for row_id in sorted(rows) if (e := self._encode(rows[row_id])) is not None]
            for event in parents_first(events):
                self._ready += self._order.add(event)

    async def round(self) -> int:
        """Publish what the log holds past the last row covered; the number of batches sent. IndexUnavailable: the
        round was not stored (``resume`` before the next); LostTurn: another publisher took over."""
        safe = self._horizon.advance(await self._index.event_log.snapshot())
        rows: list[LogRow] = []
        if safe > self._last_id:
            rows = await self._index.event_log.rows(after=self._last_id, upto=safe, limit=ROWS_PER_ROUND)
        self.behind = len(rows) == ROWS_PER_ROUND
        ready, self._ready = self._ready, []
        for row in rows:
            ready += self._take(row)
        ready += self._expire()
        if not rows and not ready:
            return 0
        last_id = rows[-1].id if rows else self._last_id
        batches = await self._batches(ready)
        self._rounds += 1
        ok = await self._index.event_log.persist(
            term=self._term,
            batches=[LoggedBatch(b.seq, b.ts, b.topic, tuple(e.id for e in b.events)) for b in batches],
            next_seq=self._next_seq + len(batches),
            last_id=last_id,
            held=sorted(e.id for e in self._order.held_events()),
            waiting=self._tokens,
            keep=self._keep if self._rounds % TRIM_EVERY == 0 else None,
        )
        if not ok:
            raise LostTurn(f"term {self._term} is over")
        self._next_seq += len(batches)
        self._last_id = last_id
        for batch in batches:
            self.published += len(batch.events)
            for sink in self._sinks:
                try:
                    sink.send(batch)
                except Exception:  # a sink's failure must not stall the stream: the batch is stored, replays serve it
                    log.exception("event sink failed seq=%s", batch.seq)
        if batches:
            self._published()
        return len(batches)

    # -- order ------------------------------------------------------------------------------------------------

    def _take(self, row: LogRow) -> list[Event]:
        """The events that may go once ``row`` is read (its own, then those waiting for it), in order."""
        if row.kind == RELEASE:
            return self._ended(row.token)
        if row.kind == CONFIG_REMOVED:  # a purge: its blocks' rows before this one go under the model it names
            if self.models is not None and row.model is not None:
                self.models.learn(row.key, row.model)
            return []
        event = self._encode(row)
        if event is None:
            return self._ended(row.token)  # its children wait for it no more
        parent = event.parent_key
        if row.waits_for and parent is not None and parent != event.key:
            for token in row.waits_for:
                if token not in self._tokens:
                    self._tokens[token] = parent
                    self._since[token] = time.monotonic()
                    self._order.begin(parent)
        return self._order.add(event) + self._ended(row.token)

    def _encode(self, row: LogRow) -> Event | None:
        """The row's event; None if the codec refuses it or its block meta cannot be read (dropped alone, logged)."""
        try:
            return event_of(row, self.codec)
        except (EventEncodeError, InvalidKey, MalformedHeader) as exc:
            self.dropped += 1
            log.error("event dropped key=%s: %s", row.key[:600], exc)
            return None

    def _ended(self, token: int | None) -> list[Event]:
        """The row of the PUT ``token`` was read: at the last one their key's rows wait for, they may go (after it,
        if it is held itself)."""
        if token is None or (key := self._tokens.pop(token, None)) is None:
            return []
        self._since.pop(token, None)
        return self._order.end(key)

    def _expire(self) -> list[Event]:
        cutoff = time.monotonic() - self._hold_s
        out: list[Event] = []
        for token in [t for t, since in self._since.items() if since < cutoff]:
            log.warning(
                "events: no row of the PUT of key=%s for %.0f s; its children's go", self._tokens[token], self._hold_s
            )
            out += self._ended(token)
        return out

    # -- batches ----------------------------------------------------------------------------------------------

    async def _batches(self, events: list[Event]) -> list[Batch]:
        if not events:
            return []
        models, topics = self.models, self.topics
        if models is not None and topics is not None and topics.needs_model:
            await models.load({e.namespace for e in events if not models.known(e.namespace)})
        ts = time.time()
        out: list[Batch] = []
        for topic, group in self._by_topic(events):
            ordered = parents_first(group)
            for start in range(0, len(ordered), EVENTS_PER_BATCH):
                chunk = tuple(ordered[start : start + EVENTS_PER_BATCH])
                out.append(Batch(seq=self._next_seq + len(out), ts=ts, events=chunk, topic=topic))
        return out

    def _by_topic(self, events: list[Event]) -> list[tuple[str, list[Event]]]:
        topics = self.topics
        if topics is None:
            return [("", events)]
        if not topics.per_namespace:
            return [(topics.render(namespace="", model=""), events)]
        models = self.models
        named: dict[str, str] = {}
        out: dict[str, list[Event]] = {}
        for e in events:
            topic = named.get(e.namespace)
            if topic is None:
                model = models.get(e.namespace) if models else None
                topic = named[e.namespace] = topics.render(namespace=e.namespace, model=model)
            out.setdefault(topic, []).append(e)
        return list(out.items())


class PublisherRole:
    """A gateway process's candidacy: waits for its turn, then publishes until it stops or loses the turn.
    ``sockets``: what the publisher binds while it holds the turn (the ZMQ sockets: ZmqOutlet.bound); ``wake``: set
    when a change committed here (the publisher reads the log at once rather than at the next poll)."""

    def __init__(
        self,
        *,
        publisher: Publisher,
        index: Index,
        coordinator: Coordinator | None,
        sockets: Callable[[], contextlib.AbstractAsyncContextManager[None]] | None,
        wake: asyncio.Event,
        poll_s: float,
    ) -> None:
        self.publisher = publisher
        self._index = index
        self._coordinator = coordinator
        self._sockets = sockets
        self._poll_s = poll_s
        self._wake = wake
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.leading = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-events-publisher")

    async def _run(self) -> None:
        while not self._stopping:
            try:
                async with self._turn():
                    await self._lead()
            except LostTurn as exc:
                log.warning("events: %s; standing by", exc)
            except Exception:
                log.exception("events: publisher failed; standing by")
            if not self._stopping:
                await asyncio.sleep(max(self._poll_s, 0.5))

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """Hold the turn to publish: this machine's ``events`` lock, then (PostgreSQL) the deployment's; and the
        ZMQ sockets, bound only by the publisher."""
        async with contextlib.AsyncExitStack() as held:
            if self._coordinator is not None:
                await held.enter_async_context(self._coordinator.exclusive("events"))
            await held.enter_async_context(self._index.exclusive("events", poll_s=max(self._poll_s, 0.5)))
            if self._sockets is not None:  # zmq.ZMQError if an address is taken: retried after a pause
                await held.enter_async_context(self._sockets())
            self.leading = True
            log.info("events: publishing")
            try:
                yield
            finally:
                self.leading = False

    async def _lead(self) -> None:
        """Rounds until stopped (after a last one that found nothing: what committed here before is sent)."""
        publisher = self.publisher
        while True:
            try:
                await publisher.resume()
                while True:
                    self._wake.clear()
                    published = await publisher.round()
                    if publisher.behind:
                        continue
                    if published:
                        await asyncio.sleep(ROUND_GAP_S)
                        continue
                    if self._stopping:
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self._poll_s)
            except IndexUnavailable as exc:
                if self._stopping:
                    return
                log.warning("events: %s; resuming", exc)
                await asyncio.sleep(max(self._poll_s, 0.5))

    async def close(self, *, drain_s: float = 5.0) -> None:
        """Stop; if publishing, after a last round (bounded by ``drain_s``)."""
        task, self._task = self._task, None
        if task is None:
            return
        self._stopping = True
        self._wake.set()
        if self.leading:
            with contextlib.suppress(TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(task), drain_s)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
