"""Copies of KV blocks between vLLM's paged KV tensors and pinned host buffers, in the canonical layout.

The only ``torch.cuda`` user. ``gather`` runs on a dedicated stream that first waits on the caller's current stream
(so the forward pass's KV writes are visible), selects the blocks of every layer into one contiguous device staging
tensor in canonical order ``(block, head, layer, k|v, token, head_dim)`` (permuted on the GPU), makes ONE
non-blocking copy into a pinned buffer from a bounded pool and records an event; an exhausted pool is ``None``, so
the engine never blocks. ``scatter`` is the reverse on a second stream; the compute stream must wait on its event
before reading the KV. Copies use ``uint8`` views, so bf16/fp16/fp8 are byte-exact. Without CUDA (or with CPU
tensors) the same code runs: streams become ``nullcontext``, events are complete, buffers are not pinned.

TP: a rank's tensors hold only its local heads, so the canonical bytes of all local heads ARE the rank's
``connector.layout.rank_byte_range`` of the object; ``heads=`` narrows a copy to a contiguous run of local heads.
Callers must keep vLLM from reusing the blocks until the copy's event is done: it may still be reading/writing them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from connector.layout import BlockGeometry, KVLayout, paged_geometry
from connector.pinned import (
    CompletedEvent,
    CopyEvent,
    HostBuffer,
    HostBufferPool,
    PoolExhausted,
    Releasing,
    await_event,
)

__all__ = ["BlockTransfer", "HostBuffer", "HostBufferPool", "KVLayout", "LoadHandle", "PoolExhausted", "StagedBatch"]


class StagedBatch(Releasing):
    """Blocks gathered into a host buffer. Read ``block_view`` once ``done()``; then ``release()`` the buffer."""

    def __init__(
        self, *, block_ids: Sequence[int], block_bytes: int, event: CopyEvent, buffer: HostBuffer, keep: object = None
    ) -> None:
        self.block_ids, self.block_bytes, self._event = tuple(block_ids), block_bytes, event
        self._buffer: HostBuffer | None = buffer
        self._keep = keep  # host-side inputs of the queued copy (the pinned block ids) outlive it

    def __len__(self) -> int:
        return len(self.block_ids)

    def done(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()

    async def wait(self) -> None:
        """Wait for the copy without blocking the event loop."""
        await await_event(self._event)

    def block_view(self, i: int) -> memoryview:
        """Read-only zero-copy view of block ``i``'s canonical bytes (valid until ``release()``)."""
        if self._buffer is None:
            raise RuntimeError("batch already released")
        if not 0 <= i < len(self.block_ids):
            raise IndexError(f"block {i} out of range for a batch of {len(self.block_ids)}")
        if not self._event.query():
            raise RuntimeError("batch copy not complete: wait() first")
        return self._buffer.view[i * self.block_bytes : (i + 1) * self.block_bytes].toreadonly()

    def release(self) -> None:
        """Give the buffer back to the pool (waiting for the copy first if it is still running). Idempotent."""
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self._event.synchronize()
            buffer.release()


class LoadHandle(Releasing):
    """Blocks being loaded into the KV tensors. Host buffers go back to their pool once a copy is seen complete."""

    def __init__(
        self, *, parts: Sequence[tuple[CopyEvent, HostBuffer]], device: torch.device, keep: Sequence[object] = ()
    ) -> None:
        self._parts: list[tuple[CopyEvent, HostBuffer | None]] = list(parts)
        self._device, self._keep = device, list(keep)

    def _absorb(self, other: LoadHandle) -> None:
        self._parts.extend(other._parts)
        self._keep.extend(other._keep)
        other._parts, other._keep = [], []

    def _reap(self) -> None:
        for i, (event, buffer) in enumerate(self._parts):
            if buffer is not None and event.query():
                self._parts[i] = (event, None)
                buffer.release()

    def done(self) -> bool:
        finished = all(event.query() for event, _ in self._parts)
        self._reap()
        return finished

    def synchronize(self) -> None:
        for event, _ in self._parts:
            event.synchronize()
        self._reap()

    async def wait(self) -> None:
        """Wait for the copies without blocking the event loop."""
        for event, _ in self._parts:
            await await_event(event)
        self._reap()

    async def _wait_oldest_held(self) -> bool:
        held = [event for event, buffer in self._parts if buffer is not None]
        if held:
            await await_event(held[0])
            self._reap()
        return bool(held)

    def wait_on_current_stream(self) -> None:
        """Make the caller's current CUDA stream wait for the loads (no CPU wait); a no-op without CUDA."""
        if self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device)
            for event, _ in self._parts:
                if isinstance(event, torch.cuda.Event):
                    stream.wait_event(event)

    def release(self) -> None:
        """Wait for any copy still running and give every host buffer back. Idempotent."""
        self.synchronize()


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

    A layer whose last dim is not contiguous (the CPU backend's K, ``connector.layout``) keeps its element size."""
    for word in (torch.int64, torch.int32, torch.int16, torch.uint8):
        with contextlib.suppress(RuntimeError):
            return [t.view(torch.uint8).view(word) for t in layers]
    same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return [t.view(same_size[t.element_size()]) for t in layers]


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
    ) -> None:
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
        new_stream = torch.cuda.Stream if self._cuda else None
        self._store_stream = new_stream(device=self.device) if new_stream else None  # type: ignore[no-untyped-call]
        self._load_stream = new_stream(device=self.device) if new_stream else None  # type: ignore[no-untyped-call]
        capacity = max_blocks_per_batch * self.geometry.block_bytes
        self.store_pool = HostBufferPool(num_buffers=store_buffers, buffer_bytes=capacity, pin=self._cuda)
        self.load_pool = HostBufferPool(num_buffers=load_buffers, buffer_bytes=capacity, pin=self._cuda)

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
    def _on(self, stream: torch.cuda.Stream | None, block_ids: Sequence[int]) -> Iterator[tuple[torch.Tensor, ...]]:
        """Run on ``stream`` after all work queued on the caller's current stream; yields (host ids, device ids)."""
        host = torch.tensor(list(block_ids), dtype=torch.int64)
        if stream is None:
            yield host, host
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = host.pin_memory()  # a pageable copy would sync the stream; the caller keeps ``host`` alive
            yield host, host.to(self.device, non_blocking=True)

    def _record(self, stream: torch.cuda.Stream | None) -> CopyEvent:
        if stream is None:
            return CompletedEvent()
        event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def _staging(self, n: int, heads: range) -> torch.Tensor:
        g, row = self.geometry, self._layers[0]
        shape = (n, len(heads), g.num_layers, 2, g.block_size, row.shape[-1])
        return torch.empty(shape, dtype=row.dtype, device=self.device)

    def gather(self, block_ids: Sequence[int], *, heads: range | None = None) -> StagedBatch | None:
        """Start copying ``block_ids`` out in canonical bytes; ``None`` when no store buffer is free (drop it)."""
        self._check_ids(block_ids, unique=False)
        sel = self._heads(heads)
        buffer = self.store_pool.try_acquire()
        if buffer is None:
            return None
        head_dim, perm = self.layout.head_dim, self.layout.to_canonical
        try:
            with self._on(self._store_stream, block_ids) as (host_ids, ids):
                staging = self._staging(len(block_ids), sel)
                for layer, kv in enumerate(self._layers):
                    part = kv.narrow(head_dim, sel.start, len(sel)).index_select(1, ids)
                    staging[:, :, layer].copy_(part.permute(perm))
                flat = staging.view(-1).view(torch.uint8)
                buffer.tensor[: flat.numel()].copy_(flat, non_blocking=self._cuda)
                event = self._record(self._store_stream)
        except BaseException:
            buffer.release()
            raise
        nbytes = len(sel) * self.geometry.bytes_per_head
        return StagedBatch(block_ids=block_ids, block_bytes=nbytes, event=event, buffer=buffer, keep=host_ids)

    def gather_many(self, block_ids: Sequence[int], *, heads: range | None = None) -> list[StagedBatch | None]:
        """``gather`` over ``split(block_ids)``: one slot per batch, ``None`` where no buffer was free."""
        return [self.gather(chunk, heads=heads) for chunk in self.split(block_ids)]

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
    ) -> LoadHandle:
        """Start loading canonical bytes (one block per item of ``data``) into ``block_ids``.

        ``buffer``, if given, is a buffer held from ``load_pool``; the returned handle owns it from then on (also
        on error). With ``data=None`` it already holds the blocks back to back (filled from the network). Without
        ``buffer`` one is taken from the pool, or ``PoolExhausted`` is raised (async callers: ``scatter_many``).
        """
        if buffer is not None and (buffer.pool is not self.load_pool or not buffer.held):
            raise ValueError("buffer must be held from this transfer's load_pool")
        if buffer is None:
            if data is None:
                raise ValueError("data=None needs the buffer that holds the blocks")
            if (buffer := self.load_pool.try_acquire()) is None:
                raise PoolExhausted("no load buffer free")
        head_dim, perm = self.layout.head_dim, self.layout.from_canonical
        try:
            self._check_ids(block_ids, unique=True)
            sel = self._heads(heads)
            nbytes = len(sel) * self.geometry.bytes_per_head
            if data is not None:
                self._check_data(block_ids, data, nbytes)
                for i, d in enumerate(data):
                    buffer.view[i * nbytes : (i + 1) * nbytes] = memoryview(d).cast("B")
            with self._on(self._load_stream, block_ids) as (host_ids, ids):
                staging = self._staging(len(block_ids), sel)
                flat = staging.view(-1).view(torch.uint8)
                flat.copy_(buffer.tensor[: flat.numel()], non_blocking=self._cuda)
                for layer, kv in enumerate(self._layers):
                    dest = kv.narrow(head_dim, sel.start, len(sel))
                    dest.index_copy_(1, ids, staging[:, :, layer].permute(perm))
                event = self._record(self._load_stream)
        except BaseException:
            buffer.release()
            raise
        return LoadHandle(parts=[(event, buffer)], device=self.device, keep=[host_ids])

    async def scatter_many(
        self, block_ids: Sequence[int], data: Sequence[bytes | memoryview], *, heads: range | None = None
    ) -> LoadHandle:
        """``scatter`` of any number of blocks, batch by batch, waiting (without blocking) for load buffers."""
        self._check_data(block_ids, data, self.block_bytes(heads=heads))
        if len(set(block_ids)) != len(block_ids):
            raise ValueError("duplicate block ids in a load")
        for chunk in self.split(block_ids):
            self._check_ids(chunk, unique=True)
        handle, step = LoadHandle(parts=(), device=self.device), self.max_blocks_per_batch
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
                handle._absorb(self.scatter(block_ids[piece], data[piece], heads=heads, buffer=buffer))
        except BaseException:
            handle.release()
            raise
        return handle
