"""ByteBudget: the bytes in flight of one BlockClient, shared by every way into vLLM.

The connector's stores ``reserve`` from the worker thread and are dropped when they do not fit (never waited for);
the tier's transfers ``hold`` on the client's loop and wait for room. A release from any thread wakes the waiters.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator


class ByteBudget:
    """At most ``limit`` bytes held at once; a ``hold`` larger than the limit runs alone."""

    def __init__(self, *, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        self.limit = limit
        self._loop = loop
        self._used = 0
        self._lock = threading.Lock()
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def used(self) -> int:
        return self._used

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` now (any thread); False when they do not fit."""
        with self._lock:
            if self._used + nbytes > self.limit:
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` (any thread); transfers waiting in ``hold`` try again."""
        with self._lock:
            self._used -= nbytes
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _take(self, nbytes: int) -> bool:
        """Take ``nbytes`` if they fit, or if nothing is in flight (a transfer larger than the budget runs alone)."""
        with self._lock:
            if self._used != 0 and self._used + nbytes > self.limit:
                return False
            self._used += nbytes
            return True

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int, *, timeout_s: float) -> AsyncIterator[None]:
        """On the loop: wait (at most ``timeout_s``, then TimeoutError) for ``nbytes``; hold them in the block."""
        async with asyncio.timeout(timeout_s):
            while not self._take(nbytes):
                # no await between the failed take and the append: a release's wake-up runs after it, on the loop
                fut = self._loop.create_future()
                self._waiters.append(fut)
                await fut
        try:
            yield
        finally:
            self.release(nbytes)
