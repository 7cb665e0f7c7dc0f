"""What the core tells the KV events of each change (app/events implements it; the core never imports that)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, Protocol

from app.index import BlockRecord, LogNote


class EventSink(Protocol):
    """What the core calls: for each change's log row, after each commit, around each PUT, on a config."""

    def note(self, key: str) -> LogNote | None:
        """What the event-log row of the change of ``key`` about to be queued carries (None: nothing to add)."""
        ...

    def stored(self, record: BlockRecord) -> None: ...

    def removed(self, record: BlockRecord) -> None: ...

    def writing(self, key: str) -> contextlib.AbstractAsyncContextManager[None]:
        """Around a PUT of ``key`` (whole or a part): its children's rows are held for it (app/events/order.py)."""
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
