"""Worker threads for the blocking calls of the data path, at a few microseconds of CPU per call.

A small PUT hands its file work to a thread two or three times (create, write and seal the staged file; publish
it), and a GET one or two (open, read). Through ``anyio.to_thread.run_sync`` such a hop cost about 68 us of CPU
on this machine (a cancel scope, a capacity limiter, a ``queue.Queue`` per worker: several Python-level locks per
hop), through ``loop.run_in_executor`` 16-25 us; this pool hands the call over one ``queue.SimpleQueue`` (C) and
returns its result with one ``call_soon_threadsafe``: 4-10 us (``python -m benchmarks.threads_hop``).

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

_Item = tuple[Callable[..., Any], tuple[Any, ...], "asyncio.Future[Any]", asyncio.AbstractEventLoop]


def _resolve(fut: asyncio.Future[Any], result: Any) -> None:
    if not fut.done():
        fut.set_result(result)


def _reject(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


class Threads:
    """A pool of worker threads; ``await threads.run(fn, *args)`` is ``fn(*args)`` on one of them."""

    def __init__(self, *, max_threads: int = MAX_THREADS, name: str = "kvgate-io") -> None:
        self._max = max_threads
        self._name = name
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        """Threads waiting for a call, less the calls handed to them and not yet taken."""
        self._threads: list[threading.Thread] = []

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        self._submit((fn, args, fut, loop))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            # the call runs on to its end: wait for it (through further cancellations), then be cancelled
            while not fut.done():
                try:
                    await asyncio.shield(fut)
                except asyncio.CancelledError:
                    continue
                except BaseException:
                    break
            if not fut.cancelled():
                fut.exception()  # retrieved: no "exception was never retrieved" for a result nobody awaits
            raise

    def _submit(self, item: _Item) -> None:
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
            item = self._queue.get()
            if item is None:
                return
            fn, args, fut, loop = item
            try:
                result = fn(*args)
            except BaseException as exc:
                done: Callable[..., None] = _reject
                value: Any = exc
            else:
                done, value = _resolve, result
            with self._lock:
                self._idle += 1
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for this call any more
                loop.call_soon_threadsafe(done, fut, value)
            del item, fn, args, fut, loop, value

    def close(self) -> None:
        """Let every thread end once the calls handed to it are done (a pool of a test's own)."""
        for _ in self._threads:
            self._queue.put(None)
        self._threads.clear()


_default: tuple[int, Threads] | None = None
_default_lock = threading.Lock()


def threads() -> Threads:
    """This process's pool (a child after ``fork`` makes its own: threads do not cross a fork)."""
    global _default
    pid = os.getpid()
    current = _default
    if current is not None and current[0] == pid:
        return current[1]
    with _default_lock:
        if _default is None or _default[0] != pid:
            _default = (pid, Threads())
        return _default[1]


async def run_sync(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread of this process's pool (see the module docstring)."""
    return await threads().run(fn, *args)
