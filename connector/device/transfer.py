"""Copies of KV blocks between vLLM's paged KV tensors and pinned host buffers, in the canonical layout.

Streams and events go through ``connector.device.streams`` (``torch.cuda`` on a GPU). ``gather`` runs on a dedicated
stream that first waits on ``after`` (an event that vLLM's main thread recorded on its forward stream with
``mark()``; without one, on the caller's current stream), selects the blocks of every layer into the buffer's device
staging in canonical order ``(block, head, layer, k|v, token, head_dim)`` (permuted on the GPU), makes ONE
non-blocking copy into a pinned buffer from a bounded pool and records an event; an exhausted pool is ``None``, so
the engine never blocks. ``scatter`` is the reverse on a second stream, and it too waits on ``after``: a load is
scattered from the client's loop thread, whose current stream orders nothing against the forward pass. The forward
stream must wait on a load's event before reading the KV. Copies use ``uint8`` views, so bf16/fp16/fp8 are
byte-exact. Without CUDA (CPU tensors) the same code runs with no streams: events are complete, buffers not pinned.

Memory: each pool buffer owns a device staging tensor of its size, allocated once here (``staging_bytes``), so the
side streams allocate nothing per copy. A buffer (and its staging) goes back to its pool only after the event of its
last copy completed, errors included; one whose copy cannot be fenced stays out (logged).

TP: a rank's tensors hold only its local heads, so the canonical bytes of all local heads ARE the rank's
``connector.device.layout.rank_byte_range`` of the object; ``heads=`` narrows a copy to a contiguous run of local heads.
Callers must keep vLLM from reusing the blocks until the copy's event is done: it may still be reading/writing them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
from collections.abc import Iterator, Sequence

import torch

from connector.device.layout import BlockGeometry, KVLayout, paged_geometry
from connector.device.pinned import (
    CompletedEvent,
    EventWaiter,
    HostBuffer,
    HostBufferPool,
    LoadHandle,
    PoolExhausted,
    StagedBatch,
)
from connector.device.streams import CopyEvent, CudaStreams, StreamOps

log = logging.getLogger("kvgate.connector.transfer")

__all__ = ["BlockTransfer", "HostBuffer", "HostBufferPool", "KVLayout", "LoadHandle", "PoolExhausted", "StagedBatch"]


def _check_kv_caches(kv_caches: dict[str, torch.Tensor], layout: KVLayout) -> BlockGeometry:
    if not kv_caches:
        raise ValueError("no KV caches")
    first = next(iter(kv_caches.values()))
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"layer {name}: needs the shape, dtype and device of the others")
    return paged_geometry(shape=first.shape, layout=layout, num_layers=len(kv_caches), itemsize=first.element_size())


def _words(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The layers reinterpreted as the widest integer words all their strides allow: bit copies, fewer elements.

    A layer whose last dim is not contiguous (the CPU backend's K, ``connector.device.layout``) keeps its element
    size."""
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        with contextlib.suppress(RuntimeError):
            return [t.view(torch.uint8).view(word) for t in layers]
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return [t.view(same_size[t.element_size()]) for t in layers]


@contextlib.contextmanager
def one_copy_thread() -> Iterator[None]:
    """CPU tensors: copy on the calling thread alone. A block's layers are many small copies, each one of torch's
    parallel regions; with the cores shared (an engine, the client's loop, other processes) every region waits for
    its slowest thread to be scheduled, and a gather falls far behind a raw PUT with one other busy process, where on
    one thread it keeps up (``python -m benchmarks.connector.pipeline --busy 1``; docs/benchmarks.md). The caller's
    setting is restored after."""
    threads = torch.get_num_threads()
    if threads == 1 or not inspect.isbuiltin(torch.set_num_threads):
        # vLLM's CPU worker binds its OpenMP threads to cores and replaces torch.set_num_threads (a builtin) with a
        # Python stub that only warns: the engine's setting stands (and a warning per copy would flood its log)
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class BlockTransfer:
    """Gathers and scatters blocks of one KV-cache group; ``kv_caches`` is ordered by layer, as vLLM registers it."""

    def __init__(
        self,
        *,
        kv_caches: dict[str, torch.Tensor],
        layout: KVLayout,
        max_blocks_per_batch: int,
        store_buffers: int,
        load_buffers: int,
        streams: StreamOps | None = None,
    ) -> None:
        """``streams``: the device's stream operations (default: ``torch.cuda`` for CUDA tensors, none for CPU)."""
        if max_blocks_per_batch <= 0:
            raise ValueError("max_blocks_per_batch must be positive")
        self.layout = KVLayout(layout)
        self.geometry = _check_kv_caches(kv_caches, self.layout)
        """Geometry of the local block (this rank's heads only)."""
        self.max_blocks_per_batch = max_blocks_per_batch
        first = next(iter(kv_caches.values()))
        self.device, self.num_blocks = first.device, first.shape[1]
        self._layers = _words(list(kv_caches.values()))
        self._cuda = self.device.type == "cuda"
        if streams is None and self._cuda:
            streams = CudaStreams(self.device)
        self.streams = streams
        self._store_stream = streams.new_stream() if streams else None
        self._load_stream = streams.new_stream() if streams else None
        capacity = max_blocks_per_batch * self.geometry.block_bytes
        self.store_pool = HostBufferPool(num_buffers=store_buffers, buffer_bytes=capacity, pin=self._cuda)
        self.load_pool = HostBufferPool(num_buffers=load_buffers, buffer_bytes=capacity, pin=self._cuda)
        self.staging_bytes = 0
        """Device memory held for staging (outside vLLM's memory profile: it is allocated after it, once)."""
        if streams is not None:
            for buffer in (*self.store_pool.buffers, *self.load_pool.buffers):
                buffer.staging = torch.empty(capacity, dtype=torch.uint8, device=self.device)
                self.staging_bytes += capacity
        self.waiter = EventWaiter(streams=streams)
        log.info(
            "block transfer: %d+%d host buffers of %d bytes (pinned=%s), %d bytes of device staging",
            store_buffers,
            load_buffers,
            capacity,
            self._cuda,
            self.staging_bytes,
        )

    def close(self) -> None:
        self.waiter.close()

    # -- ordering against the caller's streams -------------------------------------------------------------

    def mark(self) -> CopyEvent:
        """An event on the calling thread's current stream: everything queued there so far (vLLM's main thread:
        the forward pass, block zeroing). Pass it as ``after`` to copies started later, from any thread."""
        if self.streams is None:
            return CompletedEvent()
        event = self.streams.new_event()
        event.record(self.streams.current_stream())
        return event

    def order_current_stream_after(self, event: CopyEvent) -> None:
        """Make the calling thread's current stream wait for ``event`` on the device (no host wait)."""
        if self.streams is not None:
            self.streams.wait_event(self.streams.current_stream(), event)

    def split(self, block_ids: Sequence[int]) -> list[Sequence[int]]:
        """``block_ids`` cut into batches of at most ``max_blocks_per_batch``, in order."""
        step = self.max_blocks_per_batch
        return [block_ids[i : i + step] for i in range(0, len(block_ids), step)]

    def block_bytes(self, *, heads: range | None = None) -> int:
        return len(self._heads(heads)) * self.geometry.bytes_per_head

    def _heads(self, heads: range | None) -> range:
        local = range(self.geometry.num_kv_heads)
        if heads is not None and (heads.step != 1 or not heads or heads.start < 0 or heads.stop > local.stop):
            raise ValueError(f"heads {heads!r} is not a non-empty contiguous range of the {local.stop} local heads")
        return local if heads is None else heads

    def _check_ids(self, block_ids: Sequence[int], *, unique: bool) -> None:
        if not 0 < len(block_ids) <= self.max_blocks_per_batch:
            raise ValueError(f"a batch holds 1..{self.max_blocks_per_batch} blocks, got {len(block_ids)}")
        for b in block_ids:  # an out-of-range id would be a device-side assert on CUDA: refuse it here
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block id {b} out of range [0, {self.num_blocks})")
        if unique and len(set(block_ids)) != len(block_ids):
            raise ValueError("duplicate block ids in a load")

    @contextlib.contextmanager
    def _on(
        self, stream: object | None, block_ids: Sequence[int], after: CopyEvent | None
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        """Run on ``stream`` after ``after`` (default: the caller's current stream); yields (host ids, device ids)."""
        host = torch.tensor(list(block_ids), dtype=torch.int64)
        with contextlib.nullcontext() if self._cuda else one_copy_thread():
            if stream is None or self.streams is None:
                yield host, host
                return
            if after is not None:
                self.streams.wait_event(stream, after)
            else:
                self.streams.wait_stream(stream, self.streams.current_stream())
            with self.streams.use(stream):
                if self._cuda:
                    host = host.pin_memory()  # a pageable copy would sync the stream; the caller keeps ``host`` alive
                yield host, host.to(self.device, non_blocking=self._cuda)

    def _record(self, stream: object | None) -> CopyEvent:
        if stream is None or self.streams is None:
            return CompletedEvent()
        event = self.streams.new_event()
        event.record(stream)
        return event

    def _give_back(self, buffer: HostBuffer, stream: object | None) -> None:
        """After an error: return ``buffer`` once whatever was queued on ``stream`` (its copies) has run."""
        if stream is not None and self.streams is not None:
            try:
                fence = self.streams.new_event()
                fence.record(stream)
                fence.synchronize()
            except BaseException:
                log.exception("a host buffer stays out of its pool: the copies that use it could not be fenced")
                return
        buffer.release()

    def _staging(self, n: int, heads: range, buffer: HostBuffer) -> tuple[torch.Tensor, bool]:
        """The canonical ``(block, head, layer, k|v, token, word)`` view that copies go through, and whether it IS
        the host buffer (no streams: the KV is in host memory, and the buffer is read or written in place)."""
        g, row = self.geometry, self._layers[0]
        shape = (n, len(heads), g.num_layers, 2, g.block_size, row.shape[-1])
        nbytes = math.prod(shape) * row.element_size()
        if buffer.staging is None:
            return buffer.tensor[:nbytes].view(row.dtype).view(shape), True
        return buffer.staging[:nbytes].view(row.dtype).view(shape), False

    def gather(
        self, block_ids: Sequence[int], *, heads: range | None = None, after: CopyEvent | None = None
    ) -> StagedBatch | None:
        """Start copying ``block_ids`` out in canonical bytes; ``None`` when no store buffer is free (drop it).

        ``after``: the event of the forward pass that wrote the blocks (``mark()`` on vLLM's main thread)."""
        self._check_ids(block_ids, unique=False)
        sel = self._heads(heads)
        buffer = self.store_pool.try_acquire()
        if buffer is None:
            return None
        head_dim, perm = self.layout.head_dim, self.layout.to_canonical
        try:
            with self._on(self._store_stream, block_ids, after) as (host_ids, ids):
                staging, in_place = self._staging(len(block_ids), sel, buffer)
                for layer, kv in enumerate(self._layers):
                    # advanced indexing, not index_select: on CPU tensors index_select makes a strided input (the
                    # CPU_ATTN page's K) contiguous first, a copy of the layer's whole cache per gather
                    part = kv.narrow(head_dim, sel.start, len(sel))[:, ids]
                    staging[:, :, layer].copy_(part.permute(perm))
                if not in_place:
                    flat = staging.view(-1).view(torch.uint8)
                    buffer.tensor[: flat.numel()].copy_(flat, non_blocking=self._cuda)
                event = self._record(self._store_stream)
        except BaseException:
            self._give_back(buffer, self._store_stream)
            raise
        nbytes = len(sel) * self.geometry.bytes_per_head
        return StagedBatch(
            block_ids=block_ids, block_bytes=nbytes, event=event, buffer=buffer, waiter=self.waiter, keep=host_ids
        )

    def gather_many(
        self, block_ids: Sequence[int], *, heads: range | None = None, after: CopyEvent | None = None
    ) -> list[StagedBatch | None]:
        """``gather`` over ``split(block_ids)``: one slot per batch, ``None`` where no buffer was free."""
        return [self.gather(chunk, heads=heads, after=after) for chunk in self.split(block_ids)]

    def _check_data(self, block_ids: Sequence[int], data: Sequence[bytes | memoryview], nbytes: int) -> None:
        if len(data) != len(block_ids):
            raise ValueError(f"{len(block_ids)} block ids but {len(data)} blocks of data")
        for i, d in enumerate(data):
            if memoryview(d).nbytes != nbytes:
                raise ValueError(f"block {i}: {memoryview(d).nbytes} bytes, expected {nbytes}")

    def scatter(
        self,
        block_ids: Sequence[int],
        data: Sequence[bytes | memoryview] | None,
        *,
        heads: range | None = None,
        buffer: HostBuffer | None = None,
        after: CopyEvent | None = None,
    ) -> LoadHandle:
        """Start loading canonical bytes (one block per item of ``data``) into ``block_ids``.

        ``after``: an event recorded by ``mark()`` on vLLM's main thread when the load was planned: the blocks'
        earlier users (the forward pass, zeroing) are queued before it. ``buffer``, if given, is a buffer held from
        ``load_pool``; the returned handle owns it from then on (also on error). With ``data=None`` it already holds
        the blocks back to back (filled from the network). Without ``buffer`` one is taken from the pool, or
        ``PoolExhausted`` is raised (async callers: ``scatter_many``).
        """
        if buffer is not None and (buffer.pool is not self.load_pool or not buffer.held):
            raise ValueError("buffer must be held from this transfer's load_pool")
        if buffer is None:
            if data is None:
                raise ValueError("data=None needs the buffer that holds the blocks")
            if (buffer := self.load_pool.try_acquire()) is None:
                raise PoolExhausted("no load buffer free")
        head_dim, perm = self.layout.head_dim, self.layout.from_canonical
        queued: object | None = None
        try:
            self._check_ids(block_ids, unique=True)
            sel = self._heads(heads)
            nbytes = len(sel) * self.geometry.bytes_per_head
            if data is not None:
                self._check_data(block_ids, data, nbytes)
                for i, d in enumerate(data):
                    buffer.view[i * nbytes : (i + 1) * nbytes] = memoryview(d).cast("B")
            queued = self._load_stream  # from here on, copies that use the buffer may be queued
            with self._on(self._load_stream, block_ids, after) as (host_ids, ids):
                staging, in_place = self._staging(len(block_ids), sel, buffer)
                if not in_place:
                    flat = staging.view(-1).view(torch.uint8)
                    flat.copy_(buffer.tensor[: flat.numel()], non_blocking=self._cuda)
                for layer, kv in enumerate(self._layers):
                    dest = kv.narrow(head_dim, sel.start, len(sel))
                    dest.index_copy_(1, ids, staging[:, :, layer].permute(perm))
                event = self._record(self._load_stream)
        except BaseException:
            self._give_back(buffer, queued)
            raise
        return LoadHandle(parts=[(event, buffer)], streams=self.streams, waiter=self.waiter, keep=[host_ids])

    async def scatter_filled(
        self,
        block_ids: Sequence[int],
        buffer: HostBuffer,
        *,
        heads: range | None = None,
        after: CopyEvent | None = None,
    ) -> LoadHandle:
        """``scatter`` of a held load buffer that already holds the blocks back to back (read into it from the
        network). With streams the copies are queued from the calling thread (the loop thread is bound to the
        device); without (host memory) they run as they are issued, so on a worker thread: the loop goes on
        reading the next blocks meanwhile."""
        if self.streams is not None:
            return self.scatter(block_ids, None, heads=heads, buffer=buffer, after=after)
        return await asyncio.to_thread(self.scatter, block_ids, None, heads=heads, buffer=buffer, after=after)

    async def scatter_many(
        self,
        block_ids: Sequence[int],
        data: Sequence[bytes | memoryview],
        *,
        heads: range | None = None,
        after: CopyEvent | None = None,
    ) -> LoadHandle:
        """``scatter`` of any number of blocks, batch by batch, waiting (without blocking) for load buffers."""
        self._check_data(block_ids, data, self.block_bytes(heads=heads))
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("duplicate block ids in a load")
        for chunk in self.split(block_ids):
            self._check_ids(chunk, unique=True)
        handle = LoadHandle(parts=(), streams=self.streams, waiter=self.waiter)
        step = self.max_blocks_per_batch
        try:
            for start in range(0, len(block_ids), step):
                buffer = self.load_pool.try_acquire()
                while buffer is None:
                    # Free one of our own finished buffers before queueing, so a big load cannot wait on itself.
                    if not await handle._wait_oldest_held():
                        buffer = await self.load_pool.acquire()
                        break
                    buffer = self.load_pool.try_acquire()
                piece = slice(start, start + step)
                handle._absorb(self.scatter(block_ids[piece], data[piece], heads=heads, buffer=buffer, after=after))
        except BaseException:
            handle.release()
            raise
        return handle
