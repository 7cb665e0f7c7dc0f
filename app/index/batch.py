"""Point reads of the index, batched the way the writes are group-committed.

Every PUT reads its key's row before it writes (create-only, identical re-put, capacity), and every HEAD or GET
that misses the metadata cache reads one too. One read costs a connection checkout and several hops to the
driver's thread; under load most of a PUT's index time went there. ``ReadBatcher`` runs at most ``in_flight``
queries at once: keys asked for while they run wait and go together in the next one (``WHERE key IN (...)``).
A lone read is not delayed; a read never returns a row older than the moment it was asked for, since its query
starts after it was queued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

R = TypeVar("R")
Fetch = Callable[[Sequence[str]], Awaitable[dict[str, R]]]


class ReadBatcher(Generic[R]):
    def __init__(self, fetch: Fetch[R], *, in_flight: int = 1, max_keys: int = 500) -> None:
        self._fetch = fetch
        self._slots = in_flight
        self._max_keys = max_keys
        self._waiting: dict[str, list[asyncio.Future[R | None]]] = {}
        self._running: set[asyncio.Task[None]] = set()

    async def get(self, key: str) -> R | None:
        fut: asyncio.Future[R | None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, []).append(fut)
        self._launch()
        return await fut

    def _launch(self) -> None:
        while self._waiting and len(self._running) < self._slots:
            keys = list(self._waiting)[: self._max_keys]
            batch = {k: self._waiting.pop(k) for k in keys}
            task = asyncio.get_running_loop().create_task(self._run(batch))
            self._running.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._launch()

    async def _run(self, batch: dict[str, list[asyncio.Future[R | None]]]) -> None:
        try:
            found = await self._fetch(list(batch))
        except Exception as exc:
            for futs in batch.values():
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(exc)
            return
        except BaseException:  # cancelled (shutdown): the callers are too
            for futs in batch.values():
                for fut in futs:
                    fut.cancel()
            raise
        for key, futs in batch.items():
            row = found.get(key)
            for fut in futs:
                if not fut.done():
                    fut.set_result(row)
