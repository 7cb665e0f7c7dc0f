"""What a process remembers per namespace from the namespace's config: the block size its layout check enforces,
the model name its events' topic names.

Looked up in the index once per namespace: a config never changes (its fields are part of the namespace's digest).
But it may be stored after a process first looked, by another process (a worker of ``--workers N``, a replica) that
does not tell this one, so "no config" is remembered only for ``NAMESPACE_RETRY_S``: the next use after that looks
again. Kept for at most ``entries`` namespaces, the oldest forgotten first.

A lookup is made once however many requests need it at the same moment (:meth:`NamespaceMemo.fetch`): when "no
config" was last believed, the sixteen PUTs of a namespace that came next each asked the index, and the async
engine's pool opened (and closed) an overflow connection, a thread and the database's files for each one past its
fifth: ten connections a second under a steady PUT load.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

NAMESPACE_RETRY_S = 0.5
"""How long "this namespace has no config" is believed before the index is asked again."""

T = TypeVar("T")


class NamespaceMemo(Generic[T]):
    """Namespace -> what its config says (None: it has none, or says nothing of it), as looked up here."""

    def __init__(self, *, entries: int = 4096, retry_s: float = NAMESPACE_RETRY_S) -> None:
        self._entries = entries
        self.retry_s = retry_s
        self._values: dict[str, tuple[T | None, float]] = {}
        """Namespace -> (value, when it was looked up: monotonic)."""
        self._fetching: dict[str, asyncio.Future[T | None]] = {}
        """Namespace -> its lookup under way (every caller that needs it meanwhile waits for this one)."""

    async def fetch(self, namespace: str, lookup: Callable[[str], Awaitable[T | None]]) -> T | None:
        """The namespace's value: remembered (:meth:`known`), else ``lookup(namespace)``, one at a time per
        namespace (callers that come while it runs share its answer, or its error), and remembered."""
        if self.known(namespace):
            return self.get(namespace)
        pending = self._fetching.get(namespace)
        if pending is None:
            pending = self._fetching[namespace] = asyncio.ensure_future(self._look(namespace, lookup))
        # shielded: a caller that goes away does not cancel the lookup the others wait for
        return await asyncio.shield(pending)

    async def _look(self, namespace: str, lookup: Callable[[str], Awaitable[T | None]]) -> T | None:
        try:
            value = await lookup(namespace)
            self.put(namespace, value)
            return value
        finally:
            self._fetching.pop(namespace, None)

    def known(self, namespace: str) -> bool:
        """Its value is remembered, or it was found without one less than ``retry_s`` ago."""
        item = self._values.get(namespace)
        return item is not None and (item[0] is not None or time.monotonic() - item[1] < self.retry_s)

    def get(self, namespace: str) -> T | None:
        item = self._values.get(namespace)
        return None if item is None else item[0]

    def put(self, namespace: str, value: T | None) -> None:
        if namespace not in self._values and len(self._values) >= self._entries:
            del self._values[next(iter(self._values))]
        self._values[namespace] = (value, time.monotonic())

    def drop(self, namespace: str) -> None:
        self._values.pop(namespace, None)
