"""The scrub: stored bytes read back in the background, at a bounded rate, and checked against their rows.

A pass walks a snapshot of the rows (a key changed since is checked as it is now; one gone is skipped). Each block is
read as a GET reads it, the version its row names, and hashed in its row's algorithm: bytes a disk or an object
store changed without a write (bit rot, a torn sector, an object truncated behind the gateway's back) are found
before a reader takes them for a hit. A block whose bytes are not its row's is condemned by upkeep, holding the key
(``Upkeep.condemn``): its bytes quarantined first, then its row removed, which logs a ``BlockRemoved`` event; from
then on it is a miss. A row whose version is not there at all is settled as a reader would (``Upkeep.repair``).

Passes run every ``scrub_interval_s`` (the first ``scrub_delay_s`` after start), reading at most
``scrub_bytes_per_s``; one process of a machine scrubs at a time (the coordination file's ``scrub`` lock: the other
workers skip that pass). ``kvgate scrub`` runs one pass for an operator, beside running gateways.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.core.coordination import Coordinator
from app.core.upkeep import Settled, Upkeep
from app.errors import KVGateError
from app.index import Index
from contract.keys import InvalidKey, parse_block_key

log = logging.getLogger("kvgate.scrub")

Progress = Callable[[int, int], None]
"""progress(blocks checked, blocks in the pass)."""


@dataclass(slots=True)
class ScrubReport:
    blocks: int = 0
    """Blocks read back and found to be their rows' bytes."""
    bytes: int = 0
    """Bytes read back."""
    corrupt: int = 0
    """Blocks whose bytes were not their rows': quarantined, rows removed."""
    settled: int = 0
    """Rows whose version was not there to read (settled as a reader would: rolled forward, dropped, ...)."""
    failed: int = 0
    """Blocks that could not be read (the store failed): checked again by the next pass."""
    seconds: float = 0.0


class Pace:
    """At most ``bytes_per_s`` over the time since it began (None: no bound)."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self._rate = bytes_per_s
        self._began = time.monotonic()
        self._done = 0

    async def take(self, n: int) -> None:
        self._done += n
        if self._rate:
            wait = self._began + self._done / self._rate - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)


class Scrub:
    def __init__(
        self,
        *,
        upkeep: Upkeep,
        index: Index,
        coordinator: Coordinator | None,
        bytes_per_s: float | None,
        interval_s: float = 0.0,
        delay_s: float = 0.0,
    ) -> None:
        self._upkeep = upkeep
        self._index = index
        self._coordinator = coordinator
        self.bytes_per_s = bytes_per_s
        self.interval_s = interval_s
        """Seconds from the start of one pass to the start of the next (0: no background passes)."""
        self.delay_s = delay_s
        self._task: asyncio.Task[None] | None = None
        # what /metrics shows: every pass this process ran, and where the current one is
        self.blocks_checked = 0
        self.bytes_checked = 0
        self.corrupt_found = 0
        self.passes = 0
        self.pass_done = 0
        self.pass_total = 0
        self.last_pass_end: float | None = None
        """Wall-clock time the last whole pass of this process ended (None: none yet)."""

    async def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvgate-scrub")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        await asyncio.sleep(self.delay_s)
        while True:
            began = time.monotonic()
            try:
                await self._one_of_many()
            except KVGateError as exc:  # an outage of the index or the store: the next pass tries again
                log.warning("scrub pass failed: %s", exc)
            await asyncio.sleep(max(0.0, began + self.interval_s - time.monotonic()))

    async def _one_of_many(self) -> None:
        """A pass, unless another process of this machine is scrubbing now."""
        if self._coordinator is None:
            await self.run()
            return
        fd = self._coordinator.try_exclusive("scrub")
        if fd is None:
            return
        try:
            await self.run()
        finally:
            self._coordinator.release_exclusive("scrub", fd)

    async def run(self, *, progress: Progress | None = None) -> ScrubReport:
        """One pass over every row; what it found."""
        began = time.monotonic()
        report = ScrubReport()
        pace = Pace(self.bytes_per_s)
        keys = sorted(await self._index.scans.block_versions())
        self.pass_done, self.pass_total = 0, len(keys)
        for key in keys:
            try:
                block = parse_block_key(key)
            except InvalidKey:
                continue
            try:
                outcome, nbytes = await self._upkeep.verify(block, pace=pace.take)
            except KVGateError as exc:
                report.failed += 1
                log.warning("scrub could not check key=%s: %s", key, exc)
                continue
            finally:
                self.pass_done += 1
                if progress is not None:
                    progress(self.pass_done, self.pass_total)
            report.bytes += nbytes
            self.bytes_checked += nbytes
            if outcome is Settled.KEPT:
                report.blocks += 1
                self.blocks_checked += 1
            elif outcome is Settled.CORRUPT:
                report.corrupt += 1
                self.corrupt_found += 1
            elif outcome is not Settled.ABSENT:
                report.settled += 1
        self.passes += 1
        self.last_pass_end = time.time()
        report.seconds = time.monotonic() - began
        log.info(
            "scrub checked=%s bytes=%s corrupt=%s settled=%s failed=%s in %.2fs",
            report.blocks,
            report.bytes,
            report.corrupt,
            report.settled,
            report.failed,
            report.seconds,
        )
        return report
