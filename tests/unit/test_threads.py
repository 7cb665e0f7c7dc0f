"""app/threads.py: results and errors come back, calls beyond the thread bound wait their turn, and a caller
cancelled while its call runs is cancelled only once the call has ended (what the store's cleanup relies on)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.threads import Threads, run_sync


async def test_results_and_errors_come_back() -> None:
    assert await run_sync(lambda a, b: a + b, 2, 3) == 5

    def boom() -> None:
        raise OSError(5, "disk")

    with pytest.raises(OSError, match="disk"):
        await run_sync(boom)


async def test_calls_past_the_bound_wait_for_a_thread() -> None:
    pool = Threads(max_threads=2, name="test")
    running = 0
    most = 0
    lock = threading.Lock()

    def work(i: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.01)
        with lock:
            running -= 1
        return i

    try:
        assert await asyncio.gather(*(pool.run(work, i) for i in range(20))) == list(range(20))
        assert most == 2
    finally:
        pool.close()


async def test_a_cancelled_caller_waits_for_its_call_to_end() -> None:
    """The call goes on after the caller is cancelled; the cancellation reaches the caller only after the call has
    ended, so code after it (a staged file's cleanup) never runs while the call still works."""
    started, release = threading.Event(), threading.Event()
    done: list[str] = []

    def call() -> str:
        started.set()
        release.wait(5)
        time.sleep(0.05)
        done.append("call")
        return "result"

    async def caller() -> None:
        try:
            await run_sync(call)
        finally:
            done.append("caller's cleanup")

    task = asyncio.create_task(caller())
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the call
    task.cancel()  # a second cancellation does not cut the wait short either
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert done == ["call", "caller's cleanup"]
