"""KV events of the shared tier: every committed store or removal of a block, in an order a router can replay, numbered.

BlockService calls the :class:`EventSink` hooks right after a change of a key has committed (never for one that did
not), on the event loop, under the key's lock; so the calls come in commit order. Each event is encoded on its own
as it is made (app/core/events_wire.py), before it gets a number: one that cannot be encoded is dropped alone and
counted. A child block's store waits while a PUT of its parent is in progress (app/core/events_order.py), so a
router sees the parent's first. Events made in one turn of the loop go out as one batch per topic (a namespace purge
is mostly one), each with the next sequence number: to the ZMQ publisher (app/core/events_zmq.py: vLLM's wire
format), to the subscribers of ``GET /v1/events`` (JSON), and into a bounded ring for replays.

Sequence numbers after a restart: the first batch of a gateway process is numbered with the wall clock in
microseconds, so numbers go on increasing across restarts (as long as the gateway sends fewer than a million
batches a second on average) and are never reused: a subscriber sees a forward jump, the same signal as a missed
batch. It must then resync (a router re-reads the blocks it cares about with one ``POST /v1/lookup``): what was
committed between the last batch it saw and the crash was never published. ``AllBlocksCleared`` is never sent:
a restart clears nothing in the shared tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from app.core.events_meta import MAX_META_HEADER_BYTES, MAX_META_TOKENS, META_HEADER, WriterMeta, writer_meta
from app.core.events_meta import parse_meta_header as parse_meta_header
from app.core.events_order import ParentFirst, parents_first
from app.core.events_wire import EventCodec, EventEncodeError, ModelNames, Topics
from app.index import BlockRecord
from contract.keys import InvalidKey, block_path, parse_block_key

log = logging.getLogger("kvgate.events")

__all__ = [
    "MAX_META_HEADER_BYTES",
    "MAX_META_TOKENS",
    "META_HEADER",
    "EventBus",
    "EventSink",
    "WriterMeta",
    "parse_meta_header",
    "writer_meta",
]


@dataclass(frozen=True, slots=True)
class Event:
    kind: Literal["stored", "removed"]
    key: str
    namespace: str
    block_hash: str
    """Hex, as in the key."""
    group: int
    rank: int
    size: int
    digest: str | None = None
    meta: WriterMeta | None = None
    wire: bytes = b""
    """The event in vLLM's format, encoded when it was made; empty when nothing publishes that format."""

    @property
    def parent_key(self) -> str | None:
        """The key of the block this stored block continues (same namespace, rank and group), if its writer said."""
        if self.kind != "stored" or self.meta is None or self.meta.parent is None:
            return None
        return block_path(namespace=self.namespace, rank=self.rank, block_hash=self.meta.parent, group=self.group)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "BlockStored" if self.kind == "stored" else "BlockRemoved",
            "key": self.key,
            "namespace": self.namespace,
            "block_hash": self.block_hash,
            "group": self.group,
            "rank": self.rank,
            "size": self.size,
        }
        if self.kind == "stored":
            out["digest"] = self.digest
        if self.meta is not None:
            out["token_ids"] = list(self.meta.token_ids)
            out["parent_block_hash"] = self.meta.parent
        return out


@dataclass(frozen=True, slots=True)
class Batch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    topic: str = ""
    """The ZMQ topic of its events (they share one); empty without ZMQ."""

    def as_json(self, namespace: str | None = None) -> dict[str, Any] | None:
        """The batch for people (SSE); with ``namespace``, only its events (None: none left)."""
        events = [e.as_json() for e in self.events if namespace is None or e.namespace == namespace]
        if not events:
            return None
        out: dict[str, Any] = {"seq": self.seq, "ts": self.ts, "events": events}
        if self.topic:
            out["topic"] = self.topic
        return out


class BatchSink(Protocol):
    def send(self, batch: Batch) -> None:
        """Take one batch (on the loop; must not block)."""


class EventSink(Protocol):
    """What BlockService (and the PUT route) call: after each committed change, and around each PUT."""

    def stored(self, record: BlockRecord) -> None: ...

    def removed(self, record: BlockRecord) -> None: ...

    def stored_many(self, records: Iterable[BlockRecord]) -> None: ...

    def removed_keys(self, keys: Iterable[str]) -> None: ...

    def writing(self, key: str) -> contextlib.AbstractContextManager[None]:
        """Around a PUT of ``key`` (whole or a part): its children's events wait until it ends."""
        ...

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        """A namespace's config was stored (its model name goes into the events' topic)."""
        ...


class NoEvents:
    """Events off: every call is a no-op."""

    def stored(self, record: BlockRecord) -> None:
        return

    def removed(self, record: BlockRecord) -> None:
        return

    def stored_many(self, records: Iterable[BlockRecord]) -> None:
        return

    def removed_keys(self, keys: Iterable[str]) -> None:
        return

    def writing(self, key: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        return


NO_EVENTS = NoEvents()


@dataclass(eq=False)
class _Subscriber:
    queue: asyncio.Queue[Batch | None]
    overflowed: bool = False


@dataclass(eq=False)
class EventBus:
    """Numbers batches of committed changes and hands them to the sinks and subscribers (see the module doc)."""

    buffer: int = 10_000
    """Batches kept for replays (ZMQ replay socket, ``GET /v1/events?since=``)."""
    subscriber_queue: int = 10_000
    """Batches a slow SSE subscriber may lag behind before its stream is ended (it reconnects with ``since``)."""
    first_seq: int = field(default_factory=lambda: time.time_ns() // 1000)
    sinks: list[BatchSink] = field(default_factory=list)
    codec: EventCodec | None = None
    """Encodes each event as it is made (set with a ZMQ publisher, which sends those bytes)."""
    topics: Topics | None = None
    """The ZMQ topic of a namespace's events (a batch holds one topic's)."""
    models: ModelNames | None = None
    """Namespace -> model name, for ``{model}`` in the topic."""
    published: int = 0
    """Events published (all batches)."""
    dropped: int = 0
    """Events the codec refused (each dropped alone)."""
    _next_seq: int = field(init=False)
    _pending: list[Event] = field(init=False, default_factory=list)
    _order: ParentFirst[Event] = field(init=False, default_factory=ParentFirst)
    _ring: deque[Batch] = field(init=False)
    _subscribers: set[_Subscriber] = field(init=False, default_factory=set)
    _scheduled: bool = field(init=False, default=False)
    _resolving: asyncio.Task[None] | None = field(init=False, default=None)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._next_seq = self.first_seq
        self._ring = deque(maxlen=self.buffer)

    # -- the hooks BlockService calls (after a commit, on the loop) -------------------------------------------

    def stored(self, record: BlockRecord) -> None:
        self._add(self._event("stored", record, writer_meta.get()))

    def removed(self, record: BlockRecord) -> None:
        self._add(self._event("removed", record, None))

    def stored_many(self, records: Iterable[BlockRecord]) -> None:
        for record in records:
            self._add(self._event("stored", record, None))

    def removed_keys(self, keys: Iterable[str]) -> None:
        for key in keys:
            with contextlib.suppress(InvalidKey):
                k = parse_block_key(key)
                self._add(self._made("removed", key, k.namespace, k.block_hash, k.group, k.rank, 0, None, None))

    @contextlib.contextmanager
    def writing(self, key: str) -> Iterator[None]:
        self._order.begin(key)
        try:
            yield
        finally:
            self._enqueue(self._order.end(key))

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        model = fields.get("model_name")
        if self.models is not None and isinstance(model, str):
            self.models.learn(namespace, model)

    def _event(self, kind: Literal["stored", "removed"], record: BlockRecord, meta: WriterMeta | None) -> Event | None:
        block_hash = record.key.rsplit("/", 1)[-1].removesuffix(".bin")
        return self._made(
            kind, record.key, record.namespace, block_hash, record.group, record.rank, record.size, record.digest, meta
        )

    def _made(
        self,
        kind: Literal["stored", "removed"],
        key: str,
        namespace: str,
        block_hash: str,
        group: int,
        rank: int,
        size: int,
        digest: str | None,
        meta: WriterMeta | None,
    ) -> Event | None:
        """The event, encoded; None (dropped alone, counted) if the codec cannot write it."""
        wire = b""
        if self.codec is not None:
            try:
                wire = self.codec.encode(
                    kind=kind,
                    block_hash=block_hash,
                    group=group,
                    token_ids=meta.token_ids if meta is not None else (),
                    parent=meta.parent if meta is not None else None,
                )
            except EventEncodeError as exc:
                self.dropped += 1
                log.error("event dropped key=%s: %s", key, exc)
                return None
        return Event(kind, key, namespace, block_hash, group, rank, size, digest, meta, wire)

    def _add(self, event: Event | None) -> None:
        if event is not None and not self._closed:
            self._enqueue(self._order.add(event))

    def _enqueue(self, events: list[Event]) -> None:
        if not events or self._closed:
            return
        self._pending.extend(events)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)

    # -- batches ----------------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    @property
    def held(self) -> int:
        """Events waiting for a PUT of their parent to end."""
        return self._order.held

    def _turn(self) -> None:
        """Once per loop turn that made events: flush them, once the model names of their topics are known."""
        self._scheduled = False
        if self._resolving is not None:
            return  # it flushes when done
        missing = self._unnamed()
        if missing:
            self._resolving = asyncio.get_running_loop().create_task(self._resolve(missing), name="kvgate-events-names")
            return
        self.flush()

    def _unnamed(self) -> set[str]:
        if self.models is None or self.topics is None or not self.topics.needs_model:
            return set()
        return {e.namespace for e in self._pending if not self.models.known(e.namespace)}

    async def _resolve(self, namespaces: set[str]) -> None:
        try:
            if self.models is not None:
                await self.models.load(namespaces)
        finally:
            self._resolving = None
            self._turn()

    def flush(self) -> None:
        """Send what is pending: one batch per topic, each child after its parent in it."""
        if not self._pending:
            return
        events, self._pending = self._pending, []
        ts = time.time()
        for topic, group in self._by_topic(events):
            self._send(Batch(seq=self._next_seq, ts=ts, events=tuple(parents_first(group)), topic=topic))

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

    def _send(self, batch: Batch) -> None:
        self._next_seq += 1
        self.published += len(batch.events)
        self._ring.append(batch)
        for sink in self.sinks:
            try:
                sink.send(batch)
            except Exception:  # a publisher's failure must not undo or stall a committed change
                log.exception("event sink failed seq=%s", batch.seq)
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(batch)
            except asyncio.QueueFull:
                sub.overflowed = True
                self._end(sub)

    def since(self, seq: int) -> list[Batch]:
        """Batches still in the ring numbered ``seq`` or later, oldest first."""
        return [b for b in self._ring if b.seq >= seq]

    async def subscribe(self, *, since: int | None, heartbeat_s: float = 15.0) -> AsyncIterator[Batch | str]:
        """Batches from ``since`` (the ring's, then live ones), in order; a str notes a gap or the end."""
        sub = _Subscriber(asyncio.Queue(maxsize=self.subscriber_queue))
        self._subscribers.add(sub)
        try:
            last = self._next_seq - 1
            if since is not None:
                replay = self.since(since)
                if since < self._next_seq and (not replay or replay[0].seq > since):
                    yield "gap"  # asked for batches no longer (or never) held here: resync
                for batch in replay:
                    yield batch
                last = replay[-1].seq if replay else last
            while True:
                try:
                    item = await asyncio.wait_for(sub.queue.get(), heartbeat_s)
                except TimeoutError:
                    yield "heartbeat"
                    continue
                if item is None:
                    yield "overflow" if sub.overflowed else "closed"
                    return
                if item.seq > last:
                    last = item.seq
                    yield item
        finally:
            self._subscribers.discard(sub)

    async def close(self) -> None:
        if self._resolving is not None:
            with contextlib.suppress(Exception):
                await self._resolving
        self._pending.extend(self._order.drain())
        self.flush()
        self._closed = True
        self.end_streams()

    def end_streams(self) -> None:
        """End every subscriber's stream (the server is stopping: it waits for open responses to end)."""
        for sub in list(self._subscribers):
            self._end(sub)

    def _end(self, sub: _Subscriber) -> None:
        """End a subscriber's stream: what it has not read yet is dropped (it resumes with ``since``)."""
        self._subscribers.discard(sub)
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)
