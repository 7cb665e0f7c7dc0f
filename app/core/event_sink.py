"""What the core tells the KV events of each change (app/events implements it; the core never imports that).

A PUT runs inside ``EventSink.writing``, which gives it a :class:`PutInProgress`: what its writer said of the block
(``X-KVGate-Block-Meta``, parsed at the edge) and the state its children's rows wait on. The PUT hands it, as a
parameter, down to the commit of its change (``Change.commit``), which asks ``note`` what the change's event-log row
carries and tells ``stored`` that it committed one.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from app.index import BlockRecord, LogNote
from contract.wire import BlockMetaValue


@dataclass(eq=False)
class PutInProgress:
    """One PUT of ``key`` in progress in this process, as the events see it."""

    key: str
    meta: BlockMetaValue | None = None
    """What its writer said of the block: its parent's hash and its token ids."""
    submitted: bool = False
    """Its change's transaction is queued (its row, if any, comes after every row queued before)."""
    wrote: bool = False
    """It committed a row of its key."""
    token: int | None = None
    """Set when a child's row first waits for it: its rows (a store or a release) carry it."""


class EventSink(Protocol):
    """What the core calls: for each change's log row, after each commit, around each PUT, on a config."""

    def note(self, key: str, put: PutInProgress | None) -> LogNote | None:
        """What the event-log row of the change of ``key`` about to be queued carries (None: nothing to add);
        ``put``: the PUT making the change, if one is."""
        ...

    def stored(self, record: BlockRecord, put: PutInProgress | None) -> None: ...

    def removed(self, record: BlockRecord) -> None: ...

    def writing(
        self, key: str, meta: BlockMetaValue | None
    ) -> contextlib.AbstractAsyncContextManager[PutInProgress | None]:
        """Around a PUT of ``key`` (whole or a part) whose writer said ``meta``: its children's rows are held for it
        (app/events/order.py)."""
        ...

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        """A namespace's config was stored (its model name goes into the events' topic)."""
        ...


class NoEvents:
    """Nothing to add: events off, or a process without PUTs (``kvgate gc``, ``kvgate import``: with events on, the
    index writes their changes' rows all the same)."""

    def note(self, key: str, put: PutInProgress | None) -> LogNote | None:
        return None

    def stored(self, record: BlockRecord, put: PutInProgress | None) -> None:
        return

    def removed(self, record: BlockRecord) -> None:
        return

    @contextlib.asynccontextmanager
    async def writing(self, key: str, meta: BlockMetaValue | None) -> AsyncIterator[PutInProgress | None]:
        yield None

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        return


NO_EVENTS = NoEvents()
