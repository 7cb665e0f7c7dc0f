"""What a process remembers per namespace from the namespace's config: the block size its layout check enforces,
the model name its events' topic names.

Looked up in the index once per namespace: a config never changes (its fields are part of the namespace's digest).
But it may be stored after a process first looked, by another process (a worker of ``--workers N``, a replica) that
does not tell this one, so "no config" is remembered only for ``NAMESPACE_RETRY_S``: the next use after that looks
again. Kept for at most ``entries`` namespaces, the oldest forgotten first.
"""

from __future__ import annotations

import time
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
