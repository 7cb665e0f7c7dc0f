"""Files the gateway re-reads while it runs (the TLS certificate, key and client-CA bundle; the tokens file): on
SIGHUP and when their stat changes. A reload builds a NEW object from the files (an SSLContext, a principal table)
in a worker thread and puts it in place of the one in use only once it loaded whole, on the event loop: what a file
no longer says (a CA taken out of the bundle, a principal taken out of the tokens file) stops counting at the next
connection or request, and a file that does not load (half written, a certificate whose key has not arrived) leaves
the object in use as it was, with an error in the log."""

from __future__ import annotations

import abc
import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Generic, TypeVar

import anyio

log = logging.getLogger("kvgate.reload")

T = TypeVar("T")
Stamp = tuple[int, int, int] | None


def stamp(path: Path | None) -> Stamp:
    """What tells a file changed: mtime, size and inode (a file replaced by rename has a new inode)."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class Reloader(abc.ABC, Generic[T]):
    """One object kept in step with its files: :meth:`reload` on demand (SIGHUP), :meth:`watch` on change."""

    what = "files"
    """For the log: ``TLS files``, ``tokens file``."""

    def __init__(self, *, files: Sequence[Path | None], interval_s: float) -> None:
        self.files = tuple(files)
        self.interval_s = interval_s
        """Seconds between two looks at the files' stat; 0: on SIGHUP only."""
        self._stamps = self._current()

    def _current(self) -> tuple[Stamp, ...]:
        return tuple(stamp(p) for p in self.files)

    @abc.abstractmethod
    def load(self) -> T:
        """Build the object from the files as they are now (runs in a worker thread); OSError or ValueError when
        they do not load."""

    @abc.abstractmethod
    def install(self, value: T) -> None:
        """Put a freshly loaded object in place of the one in use (on the event loop)."""

    async def reload(self, *, why: str) -> bool:
        """Load the files again; False (and the object in use kept) when they do not load."""
        self._stamps = await anyio.to_thread.run_sync(self._current)
        try:
            value = await anyio.to_thread.run_sync(self.load)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.error("%s not reloaded (%s), still using the previous ones: %s", self.what, why, exc)
            return False
        self.install(value)
        log.warning("%s reloaded (%s) from %s", self.what, why, ", ".join(str(p) for p in self.files if p))
        return True

    async def reload_if_changed(self) -> bool:
        if await anyio.to_thread.run_sync(self._current) == self._stamps:
            return False
        return await self.reload(why="files changed")

    async def watch(self) -> None:
        """Poll the files' stat every ``interval_s`` and reload when it changed (until cancelled)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.reload_if_changed()
