"""A gateway process's part in the KV events: the block meta and parent waits of each change's log row, and the
release rows (see the package doc)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from app.core.event_sink import PutInProgress
from app.errors import KVGateError
from app.events.order import Brackets
from app.index import BlockRecord, Index, LogNote
from contract.keys import InvalidKey, block_path, parse_block_key
from contract.wire import BlockMetaValue

log = logging.getLogger("kvgate.events")


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

    def note(self, key: str, put: PutInProgress | None) -> LogNote | None:
        token = None
        if put is not None and put.key == key:
            put.submitted = True  # its row, if any, now comes after every row queued so far
            token = put.token
        meta = put.meta if put is not None else None
        if meta is None:
            return None if token is None else LogNote(token=token)
        waits_for: tuple[int, ...] = ()
        if meta.parent is not None:
            with contextlib.suppress(InvalidKey):
                k = parse_block_key(key)
                parent = block_path(namespace=k.namespace, rank=k.rank, block_hash=meta.parent, group=k.group)
                waits_for = self._brackets.hold_for(parent) if parent != key else ()
        return LogNote(meta=meta.header(), waits_for=waits_for, token=token)

    def stored(self, record: BlockRecord, put: PutInProgress | None) -> None:
        if put is not None and put.key == record.key:
            put.wrote = True
        self._committed()

    def removed(self, record: BlockRecord) -> None:
        self._committed()

    @contextlib.asynccontextmanager
    async def writing(self, key: str, meta: BlockMetaValue | None) -> AsyncIterator[PutInProgress | None]:
        put = self._brackets.begin(key, meta)
        try:
            yield put
        finally:
            token = self._brackets.end(put)
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
            await self._index.event_log.release(key, token=token)
        except KVGateError as exc:  # the publisher stops waiting after events_hold_s
            log.warning("events: release row of key=%s not written: %s", key, exc)
        self._committed()

    def namespace_config(self, namespace: str, fields: Mapping[str, Any]) -> None:
        model = fields.get("model_name")
        if isinstance(model, str):
            self._config_stored(namespace, model)

    async def close(self) -> None:
        await asyncio.gather(*self._releasing, return_exceptions=True)
