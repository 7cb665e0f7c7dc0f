"""The load path of one worker rank, free of vLLM: GET each block straight into a load buffer, verify it, scatter.

A load moves its blocks in windows of ``max_blocks_per_batch``: each window takes one load buffer per KV-cache
group (in group order, so loads that wait for buffers never wait on each other in a cycle), GETs every block of
every group into its place in the buffer (``BlockClient.get_into``: the bytes are copied once, from the socket,
and checked against their checksum there), and scatters the buffer into the KV cache. The next window is read while
this one is scattered, so the network and the copies overlap; a load holds at most two windows of buffers.

The first block that misses, fails or is corrupt ends the load: the blocks before it are loaded, it and every later
block are reported to vLLM, which recomputes them. Parallel-agnostic runs GET this rank's byte range of each
canonical object (``ranges[g]``); others GET the rank's whole object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from connector.client import BlockClient, ConnectorError
from connector.pinned import HostBuffer
from connector.plan import BlockJob
from connector.streams import CopyEvent
from connector.transfer import BlockTransfer
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
    ) -> None:
        """``ranges[g]``: the byte range of each group-``g`` object that this rank reads (None: all of it)."""
        self.client = client
        self.naming = naming
        self.transfers = list(transfers)
        self.ranges = list(ranges)
        self.window = min(t.max_blocks_per_batch for t in self.transfers)

    async def load(self, job: BlockJob, after: Sequence[CopyEvent] | None) -> int:
        """Load ``job``'s blocks in order; how many were loaded (a prefix of them: see the module's docstring).

        ``after[g]``: the event that every scatter into group ``g`` waits on (``WorkerPipeline.start_loads``)."""
        n, started = len(job.hashes), time.monotonic()
        windows = [(s, min(n, s + self.window)) for s in range(0, n, self.window)]
        loaded, read_s, scatter_s = 0, 0.0, 0.0
        reads = [asyncio.ensure_future(self._read(job, *windows[0]))] if windows else []
        try:
            for i, (start, end) in enumerate(windows):
                t = time.monotonic()
                got, buffers = await reads.pop()
                read_s += time.monotonic() - t
                whole = got == end - start
                if whole and i + 1 < len(windows):  # read the next window while this one is scattered
                    reads.append(asyncio.ensure_future(self._read(job, *windows[i + 1])))
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
        log.debug(
            "load req=%s: %d of %d blocks in %.3fs (waiting for reads %.3fs, scattering %.3fs)",
            job.req_id,
            loaded,
            n,
            time.monotonic() - started,
            read_s,
            scatter_s,
        )
        return loaded

    async def _read(self, job: BlockJob, start: int, end: int) -> Window:
        """Take the window's buffers and GET its blocks into them; how many blocks, from ``start``, are whole."""
        buffers: list[HostBuffer] = []
        try:
            for transfer in self.transfers:
                buffers.append(await transfer.load_pool.acquire())
            # every read ends (or is cancelled) before the buffers can go back: none writes into a reused one
            results = await asyncio.gather(
                *(self._get(job, i, g, buffers[g], i - start) for i in range(start, end) for g in range(len(buffers))),
                return_exceptions=True,
            )
        except BaseException:
            _release(buffers)
            raise
        ok = [r is True for r in results]
        for r in results:
            if isinstance(r, BaseException):
                log.error("load read of req=%s crashed: %r", job.req_id, r)
        width = len(buffers)
        got = next((b for b in range(end - start) if not all(ok[b * width : (b + 1) * width])), end - start)
        return got, buffers

    async def _get(self, job: BlockJob, i: int, group: int, buffer: HostBuffer, slot: int) -> bool:
        key = self.naming.block(job.hashes[i], group)
        part = self.ranges[group]
        size = self.transfers[group].block_bytes()
        try:
            return await self.client.get_into(
                key, buffer.view[slot * size : (slot + 1) * size], byte_range=None if part is None else part
            )
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
