"""KV events of the shared tier: every committed store or removal of a block, in commit order, numbered.

BlockService calls :meth:`EventBus.stored` / :meth:`EventBus.removed` right after a change of a key has committed
(never for one that did not), on the event loop, under the key's lock; so the calls come in commit order. Events
made in one turn of the loop go out as one batch (a namespace purge is mostly one), with the next sequence number.
Each batch goes to the ZMQ publisher (app/core/events_zmq.py: vLLM's own wire format) and to the subscribers of
``GET /v1/events`` (JSON), and stays in a bounded ring for replays.

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
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from app.errors import InvalidRequest
from app.index import BlockRecord
from contract.keys import InvalidKey, parse_block_key

log = logging.getLogger("kvgate.events")

META_HEADER = "X-KVGate-Block-Meta"
MAX_META_HEADER_BYTES = 8192
MAX_META_TOKENS = 1024
_META_RE = re.compile(r"[0-9a-fA-F]{16,64}")


@dataclass(frozen=True, slots=True)
class WriterMeta:
    """What the writer of a block knows that its key does not say: the block's token ids and its parent's hash."""

    token_ids: tuple[int, ...] = ()
    parent: str | None = None
    """The parent block's hash, hex, as in its key."""


writer_meta: ContextVar[WriterMeta | None] = ContextVar("kvgate_writer_meta", default=None)
"""Set by the PUT route for the request's task; read when its change commits."""


def parse_meta_header(value: str) -> WriterMeta:
    """``X-KVGate-Block-Meta: parent=<hex>; tokens=1,2,3`` (either part may be left out), at most 8 KiB."""
    if len(value) > MAX_META_HEADER_BYTES:
        raise InvalidRequest(f"{META_HEADER} is over {MAX_META_HEADER_BYTES} bytes")
    parent: str | None = None
    tokens: tuple[int, ...] = ()
    for part in value.split(";"):
        name, sep, text = part.strip().partition("=")
        if not sep:
            if name:
                raise InvalidRequest(f"{META_HEADER}: expected name=value, got {name[:40]!r}")
            continue
        if name == "parent" and text:
            if not _META_RE.fullmatch(text):
                raise InvalidRequest(f"{META_HEADER}: parent must be a block hash (16-64 hex characters)")
            parent = text.lower()
        elif name == "tokens" and text:
            items = text.split(",")
            if len(items) > MAX_META_TOKENS:
                raise InvalidRequest(f"{META_HEADER}: more than {MAX_META_TOKENS} token ids")
            if not all(i.isdigit() and len(i) < 12 for i in items):
                raise InvalidRequest(f"{META_HEADER}: token ids must be non-negative integers")
            tokens = tuple(int(i) for i in items)
        elif name not in ("parent", "tokens"):
            raise InvalidRequest(f"{META_HEADER}: unknown field {name[:40]!r}")
    return WriterMeta(token_ids=tokens, parent=parent)


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

    def as_json(self, namespace: str | None = None) -> dict[str, Any] | None:
        """The batch for people (SSE); with ``namespace``, only its events (None: none left)."""
        events = [e.as_json() for e in self.events if namespace is None or e.namespace == namespace]
        if not events:
            return None
        return {"seq": self.seq, "ts": self.ts, "events": events}


class BatchSink(Protocol):
    def send(self, batch: Batch) -> None:
        """Take one batch (on the loop; must not block)."""


class EventSink(Protocol):
    """What BlockService calls after each committed change."""

    def stored(self, record: BlockRecord) -> None: ...

    def removed(self, record: BlockRecord) -> None: ...

    def stored_many(self, records: Iterable[BlockRecord]) -> None: ...

    def removed_keys(self, keys: Iterable[str]) -> None: ...


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


NO_EVENTS = NoEvents()


def _event(kind: Literal["stored", "removed"], record: BlockRecord, meta: WriterMeta | None) -> Event:
    return Event(
        kind=kind,
        key=record.key,
        namespace=record.namespace,
        block_hash=record.key.rsplit("/", 1)[-1].removesuffix(".bin"),
        group=record.group,
        rank=record.rank,
        size=record.size,
        digest=record.digest,
        meta=meta,
    )


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
    published: int = 0
    """Events published (all batches)."""
    _next_seq: int = field(init=False)
    _pending: list[Event] = field(init=False, default_factory=list)
    _ring: deque[Batch] = field(init=False)
    _subscribers: set[_Subscriber] = field(init=False, default_factory=set)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._next_seq = self.first_seq
        self._ring = deque(maxlen=self.buffer)

    # -- the hooks BlockService calls (after a commit, on the loop) -------------------------------------------

    def stored(self, record: BlockRecord) -> None:
        self._add(_event("stored", record, writer_meta.get()))

    def removed(self, record: BlockRecord) -> None:
        self._add(_event("removed", record, None))

    def stored_many(self, records: Iterable[BlockRecord]) -> None:
        for record in records:
            self._add(_event("stored", record, None))

    def removed_keys(self, keys: Iterable[str]) -> None:
        for key in keys:
            with contextlib.suppress(InvalidKey):
                k = parse_block_key(key)
                self._add(Event("removed", key, k.namespace, k.block_hash, k.group, k.rank, 0))

    def _add(self, event: Event) -> None:
        if self._closed:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self._pending.append(event)

    # -- batches ----------------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def flush(self) -> None:
        """Send what is pending as one batch (called once per loop turn that made events)."""
        if not self._pending:
            return
        batch = Batch(seq=self._next_seq, ts=time.time(), events=tuple(self._pending))
        self._pending = []
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
