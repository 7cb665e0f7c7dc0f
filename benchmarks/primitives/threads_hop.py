"""CPU per hop of a call to a worker thread: app/threads.py against anyio.to_thread and loop.run_in_executor.

    .venv/bin/python -m benchmarks.primitives.threads_hop [--calls 20000] [-c 16]

Each way runs ``--calls`` trivial calls from ``-c`` tasks on uvloop; the figure is the process's CPU time (every
thread) per call, and the wall time per call. Run twice: the first pass warms the threads.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable

import anyio.to_thread
import uvloop

from app.threads import Threads


def nothing() -> int:
    return 1


async def measure(name: str, call: Callable[[], Awaitable[object]], *, calls: int, concurrency: int) -> None:
    cpu, wall = time.process_time(), time.perf_counter()

    async def worker() -> None:
        for _ in range(calls // concurrency):
            await call()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    print(
        f"{name:>22}: {1e6 * (time.process_time() - cpu) / calls:6.1f} us CPU per call, "
        f"{1e6 * (time.perf_counter() - wall) / calls:6.1f} us wall"
    )


async def main(calls: int, concurrency: int) -> None:
    loop = asyncio.get_running_loop()
    executor = concurrent.futures.ThreadPoolExecutor(4)
    pool = Threads(max_threads=4)
    for _ in range(2):
        await measure("app.threads", lambda: pool.run(nothing), calls=calls, concurrency=concurrency)
        await measure(
            "anyio.to_thread", lambda: anyio.to_thread.run_sync(nothing), calls=calls, concurrency=concurrency
        )
        await measure(
            "loop.run_in_executor",
            lambda: loop.run_in_executor(executor, nothing),
            calls=calls,
            concurrency=concurrency,
        )
        await measure("no thread (a yield)", lambda: asyncio.sleep(0), calls=calls, concurrency=concurrency)
    pool.close()
    executor.shutdown()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    args = ap.parse_args()
    uvloop.run(main(args.calls, args.concurrency))
