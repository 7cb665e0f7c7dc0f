"""Usage: stored blocks and bytes, overall and per namespace, as this process knows them.

Read from the index (exact as of the last commit of any process: triggers keep a usage table in every change's
transaction) and moved in between by the exact effect of each commit this process makes (``Versions``). Capacity
reads it to admit writes and to decide when to evict; ``grew`` wakes the evictor when a commit added bytes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field


@dataclass(slots=True)
class Usage:
    blocks: int = 0
    bytes: int = 0
    by_namespace: dict[str, list[int]] = field(default_factory=dict)
    grew: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a commit of this process added bytes (cleared by whoever waits on it)."""
    settling: int = 0
    """Commits whose outcome is being read back (``Versions``): one may be in the index and not yet in the view."""

    def reset(self, rows: dict[str, tuple[int, int]]) -> None:
        """The figures read from the index: ``namespace -> (blocks, bytes)``."""
        self.by_namespace = {ns: [b, n] for ns, (b, n) in rows.items()}
        self.blocks = sum(b for b, _ in rows.values())
        self.bytes = sum(n for _, n in rows.values())

    def add(self, *, namespace: str, blocks: int, nbytes: int) -> None:
        """A commit moved usage by exactly this much."""
        self.blocks += blocks
        self.bytes += nbytes
        slot = self.by_namespace.setdefault(namespace, [0, 0])
        slot[0] += blocks
        slot[1] += nbytes
        if slot[0] <= 0 and slot[1] <= 0:
            del self.by_namespace[namespace]
        if nbytes > 0:
            self.grew.set()

    def of(self, namespace: str) -> tuple[int, int]:
        slot = self.by_namespace.get(namespace)
        return (slot[0], slot[1]) if slot else (0, 0)
