"""Worker threads for the blocking calls of the data path, at a few microseconds of CPU per call.

A small PUT hands its file work to a thread two or three times (create, write and seal the staged file; publish
it), and a GET one or two (open, read). Through ``anyio.to_thread.run_sync`` such a hop takes several Python-level
locks (a cancel scope, a capacity limiter, a ``queue.Queue`` per worker), through ``loop.run_in_executor`` fewer;
this pool hands the call over one ``queue.SimpleQueue`` (C) and returns its result with one
``call_soon_threadsafe``, the cheapest of the three (``python -m benchmarks.primitives.threads_hop``; figures:
docs/benchmarks.md).

Cancellation is anyio's default: a caller cancelled while its call runs on a thread waits for the call to end and
is then cancelled, so a blocking call never outlives the code that cleans up after it (a staged file created by a
call that finished after its caller gave up would otherwise be left behind).

One pool per process (created on first use, and again in a child after ``fork``), like anyio's default limiter:
its threads start when calls wait for one, up to ``max_threads``, and stay (they are daemon threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_THREADS = 40
"""As anyio's default: blocking file calls on a slow disk (an fsync) may each hold a thread."""


class _Call:
    """One call handed to a thread; ``finish`` runs on the caller's loop when it has ended."""

    __slots__ = ("args", "ended", "fn", "fut", "loop", "waiter")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop) -> None:
        self.fn = fn
        self.args = args
        self.loop = loop
        self.fut: asyncio.Future[Any] = loop.create_future()
        self.ended = False
        self.waiter: asyncio.Future[None] | None = None
        """Set when the caller was cancelled: it waits on this for the call to end."""

    def finish(self, ok: bool, value: Any) -> None:
        self.ended = True
        if not self.fut.done():
            if ok:
                self.fut.set_result(value)
            else:
                self.fut.set_exception(value)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Threads:
    """A pool of worker threads; ``await threads.run(fn, *args)`` is ``fn(*args)`` on one of them."""

    def __init__(self, *, max_threads: int = MAX_THREADS, name: str = "kvgate-io") -> None:
        self._max = max_threads
        self._name = name
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        """Threads waiting for a call, less the calls handed to them and not yet taken."""
        self._threads: list[threading.Thread] = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        call = _Call(fn, args, asyncio.get_running_loop())
        self._submit(call)
        try:
            result: T = await call.fut
        except asyncio.CancelledError:
            # the call runs on to its end: wait for it (through further cancellations), then be cancelled
            if not call.ended:
                call.waiter = call.loop.create_future()
                while not call.ended:
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.shield(call.waiter)
            raise
        return result

    def _submit(self, item: _Call) -> None:
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
                spawn = False
            else:
                spawn = len(self._threads) < self._max
            if spawn:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
        self._queue.put(item)
        if spawn:
            thread.start()

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                ok, value = True, call.fn(*call.args)
            except BaseException as exc:
                ok, value = False, exc
            with self._lock:
                self._idle += 1
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this call any more
                call.loop.call_soon_threadsafe(call.finish, ok, value)
            del call, value

    def close(self) -> None:
        """Let every thread end once the calls handed to it are done (a pool of a test's own)."""
        for _ in self._threads:
            self._queue.put(None)
        self._threads.clear()


_default: Threads | None = None
_default_lock = threading.Lock()


def _forget_in_child() -> None:
    global _default
    _default = None


os.register_at_fork(after_in_child=_forget_in_child)


def threads() -> Threads:
    """This process's pool (a child after ``fork`` makes its own: threads do not cross a fork)."""
    global _default
    pool = _default
    if pool is not None:
        return pool
    with _default_lock:
        if _default is None:
            _default = Threads()
        return _default


async def run_sync(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread of this process's pool (see the module docstring)."""
    return await threads().run(fn, *args)
