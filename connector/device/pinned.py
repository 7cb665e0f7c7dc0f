"""Bounded pools of host buffers (pinned when the KV lives on CUDA), the handles of copies in flight, and the waiter.

The rule every path keeps: a buffer goes back to its pool only after the event of its last copy has completed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import torch

from connector.device.streams import CopyEvent, StreamOps

__all__ = [
    "CompletedEvent",
    "CopyEvent",
    "EventWaiter",
    "HostBuffer",
    "HostBufferPool",
    "LoadHandle",
    "PoolExhausted",
    "StagedBatch",
]


class PoolExhausted(RuntimeError):
    """No pinned host buffer is free for a synchronous load."""


class CompletedEvent:
    """The event of a copy that ran synchronously (CPU tensors): already complete."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class Releasing:
    """``with x:`` calls ``x.release()`` on the way out."""

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


class EventWaiter:
    """Waits for copy events off the event loop, on threads of its own.

    Not the loop's default executor: the client hashes bodies there, and an upload's hash must not queue behind
    event waits that sit behind a long forward pass. The threads are bound to the transfers' device.
    """

    def __init__(self, *, streams: StreamOps | None, threads: int = 4) -> None:
        self._streams = streams
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="kvgate-event", initializer=self._bind
        )

    def _bind(self) -> None:
        if self._streams is not None:
            self._streams.bind_thread()

    async def wait(self, event: CopyEvent) -> None:
        # Event.synchronize releases the GIL; a blocking-sync event sleeps the worker thread instead of spinning.
        if not event.query():
            await asyncio.get_running_loop().run_in_executor(self._pool, event.synchronize)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class HostBuffer(Releasing):
    """One host buffer of a pool: a flat ``uint8`` tensor, pinned when the KV lives on CUDA."""

    def __init__(self, *, pool: HostBufferPool, tensor: torch.Tensor) -> None:
        self.pool = pool
        self.tensor = tensor
        self.view = tensor.numpy().data.cast("B")
        """Writable zero-copy view of the whole buffer (for filling a load straight from the network)."""
        self.held = False
        self.staging: torch.Tensor | None = None
        """Device staging of the same size, owned with the buffer (so it too is reused only after the copy)."""

    def release(self) -> None:
        self.pool.release(self)


class HostBufferPool:
    """A bounded set of equal host buffers. Thread-safe; async waiters may live on any event loop."""

    def __init__(self, *, num_buffers: int, buffer_bytes: int, pin: bool) -> None:
        if num_buffers <= 0 or buffer_bytes <= 0:
            raise ValueError("a pool needs at least one non-empty buffer")
        self.buffer_bytes = buffer_bytes
        self.size = num_buffers
        self._free = [
            HostBuffer(pool=self, tensor=torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin))
            for _ in range(num_buffers)
        ]
        self.buffers = tuple(self._free)
        self._lock = threading.Lock()
        self._waiters: deque[tuple[asyncio.AbstractEventLoop, asyncio.Future[HostBuffer]]] = deque()

    @property
    def available(self) -> int:
        with self._lock:
            return len(self._free)

    def _take(self) -> HostBuffer:
        buffer = self._free.pop()
        buffer.held = True
        return buffer

    def try_acquire(self) -> HostBuffer | None:
        """A free buffer, or ``None`` when all are in use (never waits)."""
        with self._lock:
            return self._take() if self._free else None

    async def acquire(self) -> HostBuffer:
        """A buffer, waiting (fairly, without polling) until one is released."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._free and not self._waiters:
                return self._take()
            future: asyncio.Future[HostBuffer] = loop.create_future()
            self._waiters.append((loop, future))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                future.result().release()
            raise

    def release(self, buffer: HostBuffer) -> None:
        if buffer.pool is not self:
            raise ValueError("buffer belongs to another pool")
        with self._lock:
            if not buffer.held:
                raise RuntimeError("host buffer released twice")
            while self._waiters:
                loop, future = self._waiters.popleft()
                if future.cancelled():
                    continue
                with contextlib.suppress(RuntimeError):  # the waiter's loop is closed: try the next one
                    loop.call_soon_threadsafe(self._hand_over, future, buffer)
                    return
            buffer.held = False
            self._free.append(buffer)

    def _hand_over(self, future: asyncio.Future[HostBuffer], buffer: HostBuffer) -> None:
        if future.done():  # the waiter went away meanwhile: pass the buffer on
            self.release(buffer)
        else:
            future.set_result(buffer)


class StagedBatch(Releasing):
    """Blocks gathered into a host buffer. Read ``block_view`` once ``done()``; then ``release()`` the buffer."""

    def __init__(
        self,
        *,
        block_ids: Sequence[int],
        block_bytes: int,
        event: CopyEvent,
        buffer: HostBuffer,
        waiter: EventWaiter,
        keep: object = None,
    ) -> None:
        self.block_ids, self.block_bytes, self.event = tuple(block_ids), block_bytes, event
        self._buffer: HostBuffer | None = buffer
        self._waiter = waiter
        self._keep = keep  # host-side inputs of the queued copy (the pinned block ids) outlive it

    def __len__(self) -> int:
        return len(self.block_ids)

    def done(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    async def wait(self) -> None:
        """Wait for the copy without blocking the event loop."""
        await self._waiter.wait(self.event)

    def block_view(self, i: int) -> memoryview:
        """Read-only zero-copy view of block ``i``'s canonical bytes (valid until ``release()``)."""
        if self._buffer is None:
            raise RuntimeError("batch already released")
        if not 0 <= i < len(self.block_ids):
            raise IndexError(f"block {i} out of range for a batch of {len(self.block_ids)}")
        if not self.event.query():
            raise RuntimeError("batch copy not complete: wait() first")
        return self._buffer.view[i * self.block_bytes : (i + 1) * self.block_bytes].toreadonly()

    def release(self) -> None:
        """Give the buffer back once the copy is complete (waiting for it if need be). Idempotent.

        If the copy cannot be waited for (a device error), the buffer stays out of its pool: it may still be read.
        """
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            self.event.synchronize()
            buffer.release()


class LoadHandle(Releasing):
    """Blocks being loaded into the KV tensors. Host buffers go back to their pool once a copy is seen complete."""

    def __init__(
        self,
        *,
        parts: Sequence[tuple[CopyEvent, HostBuffer]],
        streams: StreamOps | None,
        waiter: EventWaiter,
        keep: Sequence[object] = (),
    ) -> None:
        self._parts: list[tuple[CopyEvent, HostBuffer | None]] = list(parts)
        self._streams, self._waiter, self._keep = streams, waiter, list(keep)

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
            await self._waiter.wait(event)
        self._reap()

    async def _wait_oldest_held(self) -> bool:
        held = [event for event, buffer in self._parts if buffer is not None]
        if held:
            await self._waiter.wait(held[0])
            self._reap()
        return bool(held)

    def wait_on_current_stream(self) -> None:
        """Make the caller's current stream wait for the loads (no host wait); a no-op without streams."""
        if self._streams is not None:
            stream = self._streams.current_stream()
            for event, _ in self._parts:
                self._streams.wait_event(stream, event)

    def release(self) -> None:
        """Wait for any copy still running and give every host buffer back. Idempotent."""
        self.synchronize()
