"""What a writer says of a block that its key does not, as an event carries it: ``X-KVGate-Block-Meta: parent=<hex>;
tokens=1,2,3`` on a PUT (contract/wire.py formats and parses it), given to the PUT's change at the edge
(app/core/event_sink.py) and stored in its event-log row."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WriterMeta:
    """What the writer of a block knows that its key does not say: the block's token ids and its parent's hash."""

    token_ids: tuple[int, ...] = ()
    parent: str | None = None
    """The parent block's hash, hex, as in its key."""
