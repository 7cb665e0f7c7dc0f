"""The load path of one worker rank, free of vLLM: GET each block straight into a load buffer, verify it, scatter.

A load moves its blocks in windows of ``max_blocks_per_batch``: each window takes one load buffer per KV-cache
group (in group order, so loads that wait for buffers never wait on each other in a cycle), GETs every block of
every group into its place in the buffer (``BlockClient.get_into``: the bytes are copied once, from the socket,
and checked against their checksum there), and scatters the buffer into the KV cache. The next window is read while
this one is scattered, so the network and the copies overlap; a load holds at most two windows of buffers.

The first block that misses, fails or is corrupt ends the load: the blocks before it are loaded, it and every later
block are reported to vLLM, which recomputes them. So does the load's deadline (``BlockJob.deadline_s``, from the
cost model): when it passes, the GETs in flight are cancelled (their connections closed), the blocks read whole by
then are scattered, and the first block that was not read ends the load. Parallel-agnostic runs GET this rank's
byte range of each canonical object (``ranges[g]``); others GET the rank's whole object. A block fetched at the
request's arrival (connector/worker/prefetch.py) is copied from its host buffer instead of read from the network.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from connector.device.pinned import HostBuffer
from connector.device.streams import CopyEvent
from connector.device.transfer import BlockTransfer
from connector.http.client import BlockClient, ConnectorError
from connector.planning.cost import LoadOutcome
from connector.planning.plan import BlockJob
from connector.worker.prefetch import Prefetcher, read_whole
from contract.keys import RunNaming

log = logging.getLogger("kvgate.connector.loader")

Window = tuple[int, list[HostBuffer]]
"""Blocks of a window that were read (a prefix of it), and the window's buffers (one per group)."""


class BlockLoader:
    def __init__(
        self,
        *,
        client: BlockClient,
        naming: RunNaming,
        transfers: Sequence[BlockTransfer],
        ranges: Sequence[tuple[int, int] | None],
        prefetch: Prefetcher | None = None,
    ) -> None:
        """``ranges[g]``: the byte range of each group-``g`` object that this rank reads (None: all of it);
        ``prefetch``: blocks fetched at the request's arrival (connector/worker/prefetch.py), taken before a GET."""
        self.client = client
        self.prefetch = prefetch
        self.naming = naming
        self.transfers = list(transfers)
        self.ranges = list(ranges)
        self.window = min(t.max_blocks_per_batch for t in self.transfers)

    async def load(self, job: BlockJob, after: Sequence[CopyEvent] | None) -> LoadOutcome:
        """Load ``job``'s blocks in order; how many were loaded (a prefix of them: see the module's docstring).

        ``after[g]``: the event that every scatter into group ``g`` waits on (``WorkerPipeline.start_loads``).
        ``job.deadline_s``: past it, the GETs in flight are cancelled; the blocks read whole before it are
        scattered, the rest is reported (``LoadOutcome.expired``)."""
        n, started = len(job.hashes), time.monotonic()
        until = None if job.deadline_s is None else asyncio.get_running_loop().time() + job.deadline_s
        windows = [(s, min(n, s + self.window)) for s in range(0, n, self.window)]
        loaded, read_s, scatter_s = 0, 0.0, 0.0
        arrived = [0, 0]  # bytes of the GETs that completed, bytes taken from prefetched blocks
        reads = [asyncio.ensure_future(self._read(job, *windows[0], until, arrived))] if windows else []
        try:
            for i, (start, end) in enumerate(windows):
                t = time.monotonic()
                got, buffers = await reads.pop()
                read_s += time.monotonic() - t
                whole = got == end - start
                if whole and i + 1 < len(windows):  # read the next window while this one is scattered
                    reads.append(asyncio.ensure_future(self._read(job, *windows[i + 1], until, arrived)))
                t = time.monotonic()
                await self._scatter(job, start, got, buffers, after)
                scatter_s += time.monotonic() - t
                loaded += got
                if not whole:  # a block of this window is missing: the rest is recomputed
                    break
        except (ConnectorError, OSError, ValueError) as exc:
            log.error("load failed req=%s after %d of %d blocks: %s", job.req_id, loaded, n, exc)
        finally:
            for read in reads:
                await _drop(read)
        seconds = time.monotonic() - started
        expired = until is not None and loaded < n and asyncio.get_running_loop().time() >= until
        if expired:
            log.warning(
                "load req=%s past its deadline %.3fs: %d of %d blocks loaded, the rest is recomputed",
                job.req_id,
                job.deadline_s,
                loaded,
                n,
            )
        log.debug(
            "load req=%s: %d of %d blocks in %.3fs (waiting for reads %.3fs, scattering %.3fs)",
            job.req_id,
            loaded,
            n,
            seconds,
            read_s,
            scatter_s,
        )
        return LoadOutcome(loaded=loaded, nbytes=arrived[0], seconds=seconds, expired=expired, prefetched=arrived[1])

    async def _read(self, job: BlockJob, start: int, end: int, until: float | None, arrived: list[int]) -> Window:
        """Take the window's buffers and GET its blocks into them; how many blocks, from ``start``, are whole.

        ``until`` (loop time): the GETs still in flight then are cancelled, and their blocks are not whole.
        ``arrived[0]`` counts the bytes of every GET that completed (a block taken from the prefetched ones is no GET
        of this load: its bytes are not the load's to measure; ``arrived[1]`` counts those)."""
        buffers: list[HostBuffer] = []
        gets: list[asyncio.Task[bool]] = []
        taken = [0]
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(until):
                for transfer in self.transfers:
                    buffers.append(await transfer.load_pool.acquire())
        except TimeoutError:
            _release(buffers)
            return 0, []
        except BaseException:
            _release(buffers)
            raise
        try:
            gets = [
                asyncio.ensure_future(self._get(job, i, g, buffers[g], i - start, taken))
                for i in range(start, end)
                for g in range(len(buffers))
            ]
            await asyncio.wait(gets, timeout=None if until is None else max(0.0, until - loop.time()))
        except BaseException:
            await _stop(gets)
            _release(buffers)
            raise
        # every read ends (or is cancelled) before the buffers can go back: none writes into a reused one
        await _stop(gets)
        ok = [read_whole(t) for t in gets]
        for t in gets:
            if t.done() and not t.cancelled() and (exc := t.exception()) is not None:
                log.error("load read of req=%s crashed: %r", job.req_id, exc)
        width = len(buffers)
        arrived[0] += sum(self.transfers[j % width].block_bytes() for j, good in enumerate(ok) if good) - taken[0]
        arrived[1] += taken[0]
        got = next((b for b in range(end - start) if not all(ok[b * width : (b + 1) * width])), end - start)
        return got, buffers

    async def _get(self, job: BlockJob, i: int, group: int, buffer: HostBuffer, slot: int, taken: list[int]) -> bool:
        key = self.naming.block(job.hashes[i], group)
        part = self.ranges[group]
        size = self.transfers[group].block_bytes()
        into = buffer.view[slot * size : (slot + 1) * size]
        if self.prefetch is not None and await self.prefetch.take(job.req_id, job.hashes[i], group, into):
            taken[0] += size
            return True
        try:
            return await self.client.get_into(key, into, byte_range=None if part is None else part)
        except ConnectorError as exc:
            log.warning("load read failed key=%s: %s", key, exc)
            return False

    async def _scatter(
        self, job: BlockJob, start: int, count: int, buffers: list[HostBuffer], after: Sequence[CopyEvent] | None
    ) -> None:
        """Scatter the first ``count`` blocks of the window's buffers; the buffers are given back in every case."""
        left: list[HostBuffer | None] = list(buffers)
        handles = []
        try:
            for group, transfer in enumerate(self.transfers if count else ()):
                ids = job.block_ids[group][start : start + count]
                buffer, left[group] = buffers[group], None  # the scatter's from here on, errors included
                handles.append(
                    await transfer.scatter_filled(ids, buffer, after=None if after is None else after[group])
                )
            for handle in handles:
                await handle.wait()
        except BaseException:
            for handle in handles:
                handle.release()
            raise
        finally:
            _release([b for b in left if b is not None])


def _release(buffers: Sequence[HostBuffer]) -> None:
    for buffer in buffers:
        buffer.release()


async def _stop(tasks: Sequence[asyncio.Task[bool]]) -> None:
    """Cancel the GETs still in flight and wait until every one has ended (a cancelled GET closes its connection)."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)


async def _drop(task: asyncio.Task[Window]) -> None:
    """Stop a window's read that will not be scattered, and give its buffers back (``_read`` gives back those of
    a read that stops half-way)."""
    task.cancel()
    try:
        _got, buffers = await task
    except asyncio.CancelledError:
        return
    except Exception as exc:  # the load already ended; this read's error changes nothing
        log.debug("a dropped window's read failed: %r", exc)
        return
    _release(buffers)
