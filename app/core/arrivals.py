"""Lookups that wait for a block: woken by this process's own commits, re-checked on a short interval for the
commits of other processes.

``Versions`` calls ``Arrivals.committed(key)`` after every commit that stores a key (a PUT, a part that completes an
object, an import), on the event loop. A waiting lookup registers the first key of its prefix that is absent (the
prefix grows only when that key arrives) and sleeps until that key is committed, its re-check interval passes, or its
deadline; then it looks again. Other processes (``--workers``, replicas sharing the index) commit without telling
this one: the re-check interval bounds how late their blocks are seen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

RECHECK_S = 0.05
"""A waiting lookup looks again at least this often (blocks committed by another process wake no one here)."""
RECENT = 4096
"""Keys committed lately, remembered with their commit's number: a commit that falls between a lookup's read and
its wait is found there."""


class Arrivals:
    def __init__(self) -> None:
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        self.commits = 0
        """Commits seen so far: a lookup notes it before it reads the index, so that a commit between its read and
        its wait is not slept through."""
        self._recent: OrderedDict[str, int] = OrderedDict()

    def committed(self, key: str) -> None:
        """``key`` was committed: wake the lookups waiting for it."""
        self.commits += 1
        self._recent[key] = self.commits
        self._recent.move_to_end(key)
        if len(self._recent) > RECENT:
            self._recent.popitem(last=False)
        for waiter in self._waiting.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    @property
    def waiting(self) -> int:
        """Lookups waiting now (for a test and the metrics)."""
        return sum(len(w) for w in self._waiting.values())

    async def wait(self, key: str, *, since: int, timeout_s: float) -> bool:
        """Until ``key`` is committed here (True) or ``timeout_s`` passes (False); at once (True) when ``key`` was
        committed since ``commits`` was ``since`` (the caller's read may have missed it), or may have been (it is
        no longer remembered)."""
        if self._recent.get(key, 0) > since:
            return True
        oldest = next(iter(self._recent.values()), 0)
        if len(self._recent) >= RECENT and oldest > since + 1:
            return True
        if timeout_s <= 0:
            return False
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._waiting.setdefault(key, set())
        waiters.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(waiter), timeout=timeout_s)
            return waiter.done()
        finally:
            waiters.discard(waiter)
            if not waiters and self._waiting.get(key) is waiters:
                del self._waiting[key]
