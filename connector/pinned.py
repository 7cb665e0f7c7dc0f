"""Bounded pools of host buffers (pinned when the KV lives on CUDA) and the small event/release helpers."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from types import TracebackType
from typing import Self

import torch

from connector.streams import CopyEvent

__all__ = ["CopyEvent", "HostBuffer", "HostBufferPool", "PoolExhausted"]


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


async def await_event(event: CopyEvent) -> None:
    # Event.synchronize releases the GIL; a blocking-sync event sleeps the worker thread instead of spinning.
    if not event.query():
        await asyncio.to_thread(event.synchronize)


class HostBuffer(Releasing):
    """One host buffer of a pool: a flat ``uint8`` tensor, pinned when the KV lives on CUDA."""

    def __init__(self, *, pool: HostBufferPool, tensor: torch.Tensor) -> None:
        self.pool = pool
        self.tensor = tensor
        self.view = tensor.numpy().data.cast("B")
        """Writable zero-copy view of the whole buffer (for filling a load straight from the network)."""
        self.held = False

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
