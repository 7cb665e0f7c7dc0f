"""Fetch at arrival, the worker side: GET a request's blocks into host memory before the scheduler admits it.

The scheduler (connector/planning/plan.py: ``SchedulerPlanner.arrived``) looks a request up when vLLM first sees it
and, once the cost model says load, sends the blocks it would load as a ``StepPlan.prefetches`` entry. Each such entry
gets one host buffer per KV-cache group (pinned on CUDA), sized to its blocks, and one GET per block and group into its
place (``BlockClient.get_into``: the bytes are verified against their checksum exactly as a load's are). The buffers
are held per request, within ``budget_bytes`` (over every request, per rank): an entry that does not fit whole is
prefetched as far as it fits, and counted (``overflows``).

When the request's load runs (connector/worker/loader.py), each block it finds here is copied from the held buffer
into the load's buffer instead of being read from the network; one still in flight is waited for under the load's
deadline; one whose GET failed is read again as usual. Then the request's buffers are freed (``used``). A request that
finishes or is aborted first, or whose plan loads none of it, gets a ``StepPlan.drops`` entry: its GETs in flight are
cancelled and its buffers freed (``dropped``). Everything here runs on the client's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connector.device.transfer import BlockTransfer
from connector.http.client import BlockClient, ConnectorError
from connector.planning.plan import BlockJob
from contract.keys import RunNaming

log = logging.getLogger("kvgate.connector.prefetch")


def read_whole(task: asyncio.Future[bool]) -> bool:
    """A block's read ended, and with its bytes whole and verified (True): not pending, cancelled or failed."""
    return task.done() and not task.cancelled() and task.exception() is None and task.result() is True


@dataclass(slots=True)
class PrefetchStats:
    started: int = 0
    """Requests whose blocks were prefetched (all or, past the budget, a prefix)."""
    blocks: int = 0
    """Blocks whose GETs a prefetch started."""
    used: int = 0
    """Requests whose load took at least one prefetched block."""
    dropped: int = 0
    """Requests whose prefetched blocks were freed unused (finished, aborted, or not loaded after all)."""
    hits: int = 0
    """Loads all of whose blocks were in host memory, read and verified, when the load started."""
    overflows: int = 0
    """Prefetches cut short, or not started, because the budget was full."""


@dataclass(slots=True)
class _Held:
    views: list[memoryview]
    """Per group: the buffer of the prefetched blocks, back to back."""
    slots: dict[bytes, int]
    """Block hash -> its place in the buffers."""
    gets: list[asyncio.Task[bool]]
    """``gets[slot * groups + group]``: that block's GET (True: read whole and verified)."""
    nbytes: int
    used: bool = False


class Prefetcher:
    def __init__(
        self,
        *,
        client: BlockClient,
        naming: RunNaming,
        transfers: Sequence[BlockTransfer],
        ranges: Sequence[tuple[int, int] | None],
        budget_bytes: int,
        pin: bool,
    ) -> None:
        """``ranges[g]``: the byte range of each group-``g`` object this rank reads (None: all of it);
        ``budget_bytes``: the most host bytes held for prefetches (0: none); ``pin``: page-locked buffers."""
        self.client = client
        self.naming = naming
        self.transfers = list(transfers)
        self.ranges = list(ranges)
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.stats = PrefetchStats()
        self.held_bytes = 0
        self._held: dict[str, _Held] = {}

    @property
    def block_bytes(self) -> int:
        """The host bytes of one block over every group (this rank's part)."""
        return sum(t.block_bytes() for t in self.transfers)

    def start(self, job: BlockJob) -> None:
        """Start GETting ``job``'s blocks (``job.hashes``; it has no block ids) into host buffers, within the budget."""
        if job.req_id in self._held or not job.hashes or self.budget_bytes <= 0:
            return
        per_block = self.block_bytes
        n = min(len(job.hashes), (self.budget_bytes - self.held_bytes) // per_block)
        if n < len(job.hashes):
            self.stats.overflows += 1
            log.debug("prefetch of req=%s: %d of %d blocks fit the budget", job.req_id, max(n, 0), len(job.hashes))
        if n <= 0:
            return
        views = [
            torch.empty(n * t.block_bytes(), dtype=torch.uint8, pin_memory=self.pin).numpy().data.cast("B")
            for t in self.transfers
        ]
        gets = [
            asyncio.ensure_future(self._get(job.hashes[i], g, views[g], i)) for i in range(n) for g in range(len(views))
        ]
        self._held[job.req_id] = _Held(
            views=views, slots={bytes(h): i for i, h in enumerate(job.hashes[:n])}, gets=gets, nbytes=n * per_block
        )
        self.held_bytes += n * per_block
        self.stats.started += 1
        self.stats.blocks += n

    async def _get(self, block_hash: bytes, group: int, view: memoryview, slot: int) -> bool:
        key = self.naming.block(block_hash, group)
        size = self.transfers[group].block_bytes()
        try:
            return await self.client.get_into(key, view[slot * size : (slot + 1) * size], byte_range=self.ranges[group])
        except ConnectorError as exc:
            log.warning("prefetch read failed key=%s: %s", key, exc)
            return False

    def ready(self, job: BlockJob) -> bool:
        """True when every block of ``job`` (a load) is here, read and verified."""
        held = self._held.get(job.req_id)
        if held is None or not job.hashes:
            return False
        width = len(held.views)
        for h in job.hashes:
            slot = held.slots.get(bytes(h))
            if slot is None:
                return False
            if not all(read_whole(task) for task in held.gets[slot * width : (slot + 1) * width]):
                return False
        return True

    async def take(self, req_id: str, block_hash: bytes, group: int, into: memoryview) -> bool:
        """Copy ``req_id``'s prefetched block into ``into``, waiting for its GET if it is in flight (the caller
        bounds the wait); False when it was not prefetched or its GET failed (the caller reads it itself)."""
        held = self._held.get(req_id)
        slot = None if held is None else held.slots.get(bytes(block_hash))
        if held is None or slot is None:
            return False
        task = held.gets[slot * len(held.views) + group]
        if not task.done():
            await asyncio.wait([task])  # a cancelled caller stops waiting; the GET goes on until the release
        if not read_whole(task):
            return False
        size = self.transfers[group].block_bytes()
        if held is not self._held.get(req_id):  # released while waiting
            return False
        into[:] = held.views[group][slot * size : (slot + 1) * size]
        held.used = True
        return True

    async def release(self, req_id: str) -> None:
        """Free ``req_id``'s buffers, its GETs in flight cancelled first (none writes into freed memory)."""
        held = self._held.pop(req_id, None)
        if held is None:
            return
        for task in held.gets:
            task.cancel()
        await asyncio.wait(held.gets)
        self.held_bytes -= held.nbytes
        if held.used:
            self.stats.used += 1
        else:
            self.stats.dropped += 1

    async def close(self) -> None:
        for req_id in list(self._held):
            await self.release(req_id)
