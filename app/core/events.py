"""KV events of the shared tier: every committed store or removal of a block, in an order a router can replay, numbered
by one publisher for the whole deployment, and never numbered twice or backwards.

Three parts, each in its own module:

- **The log** (app/index/eventlog.py): with events on, every change of a block row adds a row to the index's event
  log in the change's own transaction, whoever commits it: a gateway process or replica, ``kvgate gc``,
  ``kvgate import``, reconcile. So an event exists iff its change committed, and it survives any crash.
  :class:`EventWriter` is what a gateway process adds to that: the writer's block meta (the PUT's token ids and
  parent, ``writer_meta``) and whether the row waits for its parent's (a PUT of the parent in progress here: see
  app/core/events_order.py), and a release row when such a PUT ends without a store.
- **The publisher** (app/core/events_publisher.py): one process at a time (the others stand by) tails the log,
  encodes each row on its own (a row the codec refuses is dropped alone), puts parents first, groups rows by topic
  into batches, numbers them from the number it persisted, stores them with where it stands in one transaction, then
  sends them on ZMQ (app/core/events_zmq.py: vLLM's wire format).
- **The feed** (app/core/events_feed.py): ``GET /v1/events`` (JSON) and the ZMQ replay socket read the stored
  batches, so any process serves them, after any restart, as far back as they are kept.

``AllBlocksCleared`` is never sent: a restart clears nothing in the shared tier.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from app.core.events_meta import MAX_META_HEADER_BYTES, MAX_META_TOKENS, META_HEADER, WriterMeta, writer_meta
from app.core.events_meta import parse_meta_header as parse_meta_header
from app.core.events_order import Bracket, Brackets
from app.core.events_wire import EventCodec
from app.errors import KVGateError
from app.index import BlockRecord, Index, LogNote
from app.index.eventlog import STORED, LogRow
from contract.keys import InvalidKey, block_path, parse_block_key

log = logging.getLogger("kvgate.events")

__all__ = [
    "MAX_META_HEADER_BYTES",
    "MAX_META_TOKENS",
    "META_HEADER",
    "EventSink",
    "EventWriter",
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
    """The event in vLLM's format, encoded when it was read; empty when nothing publishes that format."""
    id: int = 0
    """Its row in the event log."""

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


def event_of(row: LogRow, codec: EventCodec | None) -> Event:
    """A log row's event, encoded with ``codec`` (EventEncodeError if it cannot be; InvalidKey for a key that is
    not a block's, which no change writes)."""
    k = parse_block_key(row.key)
    kind: Literal["stored", "removed"] = "stored" if row.kind == STORED else "removed"
    meta = None if row.tokens is None and row.parent is None else WriterMeta(row.tokens or (), row.parent)
    wire = b""
    if codec is not None:
        wire = codec.encode(
            kind=kind,
            block_hash=k.block_hash,
            group=k.group,
            token_ids=meta.token_ids if meta is not None else (),
            parent=meta.parent if meta is not None else None,
        )
    digest = row.digest if row.kind == STORED else None
    return Event(kind, row.key, k.namespace, k.block_hash, k.group, k.rank, row.size, digest, meta, wire, row.id)


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
    """What the core calls: for each change's log row, after each commit, around each PUT, on a config."""

    def note(self, key: str) -> LogNote | None:
        """What the event-log row of the change of ``key`` about to be queued carries (None: nothing to add)."""
        ...

    def stored(self, record: BlockRecord) -> None: ...

    def removed(self, record: BlockRecord) -> None: ...

    def writing(self, key: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a PUT of ``key`` (whole or a part): its children's rows are held for it (app/core/events_order)."""
        ...

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        """A namespace's config was stored (its model name goes into the events' topic)."""
        ...


class NoEvents:
    """Nothing to add: events off, or a process without PUTs (``kvgate gc``, ``kvgate import``: with events on, the
    index writes their changes' rows all the same)."""

    def note(self, key: str) -> LogNote | None:
        return None

    def stored(self, record: BlockRecord) -> None:
        return

    def removed(self, record: BlockRecord) -> None:
        return

    def writing(self, key: str) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        return


NO_EVENTS = NoEvents()

_bracket: ContextVar[Bracket | None] = ContextVar("kvgate_events_bracket", default=None)
"""The PUT the current task is part of (its commit runs in a task that inherits it)."""


class EventWriter:
    """A gateway process's part in the events (the index writes the rows): each row's block meta and the parent's
    rows it waits for, release rows, and a nudge to the local publisher after each commit."""

    def __init__(
        self,
        *,
        index: Index,
        committed: Callable[[], None] = lambda: None,
        config_stored: Callable[[str, str], None] = lambda namespace, model: None,
    ) -> None:
        """``committed``: called after each commit here (the local publisher, if this process is it, reads the log
        at once); ``config_stored``: called with a namespace and its model name when its config is stored here."""
        self._index = index
        self._brackets = Brackets()
        self._releasing: set[asyncio.Task[None]] = set()
        self._committed = committed
        self._config_stored = config_stored

    def note(self, key: str) -> LogNote | None:
        bracket = _bracket.get()
        token = None
        if bracket is not None and bracket.key == key:
            bracket.submitted = True  # its row, if any, now comes after every row queued so far
            token = bracket.token
        meta = writer_meta.get()
        if meta is None:
            return None if token is None else LogNote(token=token)
        waits_for: tuple[int, ...] = ()
        if meta.parent is not None:
            with contextlib.suppress(InvalidKey):
                k = parse_block_key(key)
                parent = block_path(namespace=k.namespace, rank=k.rank, block_hash=meta.parent, group=k.group)
                waits_for = self._brackets.hold_for(parent) if parent != key else ()
        return LogNote(token_ids=meta.token_ids, parent=meta.parent, waits_for=waits_for, token=token)

    def stored(self, record: BlockRecord) -> None:
        self._wrote(record.key)

    def removed(self, record: BlockRecord) -> None:
        self._wrote(record.key)

    def _wrote(self, key: str) -> None:
        bracket = _bracket.get()
        if bracket is not None and bracket.key == key:
            bracket.wrote = True
        self._committed()

    @contextlib.asynccontextmanager
    async def writing(self, key: str) -> AsyncIterator[None]:
        bracket = self._brackets.begin(key)
        reset = _bracket.set(bracket)
        try:
            yield
        finally:
            _bracket.reset(reset)
            token = self._brackets.end(bracket)
            if token is not None:
                # children's rows wait for a row of this PUT: written before the PUT answers, so that a reader who saw
                # the answer and then asks for the events finds them published
                task = asyncio.get_running_loop().create_task(self._release(key, token), name="kvgate-events-release")
                self._releasing.add(task)
                task.add_done_callback(self._releasing.discard)
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(task)

    async def _release(self, key: str, token: int) -> None:
        try:
            await self._index.event_release(key, token=token)
        except KVGateError as exc:  # the publisher stops waiting after events_hold_s
            log.warning("events: release row of key=%s not written: %s", key, exc)
        self._committed()

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        model = fields.get("model_name")
        if isinstance(model, str):
            self._config_stored(namespace, model)

    async def close(self) -> None:
        await asyncio.gather(*self._releasing, return_exceptions=True)
