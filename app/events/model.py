"""A KV event as the publisher reads it from the log (one committed store or removal of a block), and a numbered batch
of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

from app.events.wire import EventCodec
from app.index.eventlog import STORED, LogRow
from contract.keys import block_path, parse_block_key
from contract.wire import BlockMetaValue, parse_block_meta


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
    meta: BlockMetaValue | None = None
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
            out["token_ids"] = list(self.meta.tokens)
            out["parent_block_hash"] = self.meta.parent
        return out


def event_of(row: LogRow, codec: EventCodec | None) -> Event:
    """A log row's event, encoded with ``codec`` (EventEncodeError if it cannot be; InvalidKey for a key that is
    not a block's, which no change writes; MalformedHeader for a stored block meta this release cannot read, as a
    newer one's field would be)."""
    k = parse_block_key(row.key)
    kind: Literal["stored", "removed"] = "stored" if row.kind == STORED else "removed"
    meta = None if row.meta is None else parse_block_meta(row.meta)
    wire = b""
    if codec is not None:
        wire = codec.encode(
            kind=kind,
            block_hash=k.block_hash,
            group=k.group,
            token_ids=meta.tokens if meta is not None else (),
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
