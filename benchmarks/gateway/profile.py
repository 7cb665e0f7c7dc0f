"""Where a gateway's CPU goes for one kind of request: py-spy samples a real gateway under load.

    .venv/bin/python -m benchmarks.gateway.profile --op put --size 65536 [--seconds 10] [-c 16] [--out put.txt]

Starts a gateway (filesystem backend, block fsync off, as benchmarks/gateway/cost.py), drives ``--op`` at concurrency
``-c`` from an in-process aiohttp client (a PUT phase first when the op reads), and samples the gateway with py-spy
(``pip install py-spy``; it needs ptrace, as root here) for ``--seconds``, every thread, idle time left out. Prints
the share of samples by area (a frame's file decides: the HTTP server, Starlette/FastAPI, kvgate's middleware,
routes, core, store, index, SQLAlchemy/sqlite, hashing, thread hand-offs) and the functions with the most samples
on top of the stack; ``--out`` keeps py-spy's collapsed stacks (a flame graph's input).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from app.tools.bench import BenchConfig, OpStats, Runner, bench_key
from app.tools.bench_clients import AiohttpClient
from loopback.gateway import Gateway

AREAS = (
    ("hashlib", "hashing"),
    ("sha256", "hashing"),
    ("uvicorn/", "uvicorn"),
    ("httptools", "uvicorn"),
    ("app/api/server/", "kvgate server pieces"),
    ("app/api/middleware/", "kvgate middleware"),
    ("app/api/routes/", "kvgate routes"),
    ("app/api/", "kvgate edge"),
    ("fastapi/", "fastapi"),
    ("starlette/", "starlette"),
    ("pydantic", "pydantic"),
    ("prometheus_client/", "metrics"),
    ("app/core/", "kvgate core"),
    ("app/storage/", "kvgate store"),
    ("app/index/", "kvgate index"),
    ("sqlalchemy/", "sqlalchemy"),
    ("sqlite3", "sqlite"),
    ("anyio/", "thread hand-offs (anyio)"),
    ("concurrent/futures", "thread hand-offs (anyio)"),
    ("threading.py", "thread hand-offs (anyio)"),
    ("asyncio/", "event loop"),
    ("uvloop", "event loop"),
)


def area_of(frame: str) -> str | None:
    for needle, area in AREAS:
        if needle in frame:
            return area
    return None


def summarize(collapsed: Path, *, top: int, thread: str | None = None) -> str:
    """Shares by area (the innermost frame with a known area) and by the function on top of the stack; ``thread``:
    only the samples of threads whose name starts with it (MainThread: the event loop)."""
    by_area: collections.Counter[str] = collections.Counter()
    by_leaf: collections.Counter[str] = collections.Counter()
    by_inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        count = int(n)
        frames = stack.split(";")
        if thread is not None and not frames[0].partition(": ")[2].startswith(thread):
            continue
        total += count
        by_leaf[frames[-1]] += count
        area = next((a for f in reversed(frames) if (a := area_of(f)) is not None), "other")
        by_area[area] += count
        for f in set(frames):
            if "app/" in f or "contract/" in f:
                by_inclusive[f] += count
    lines = [f"{total} samples", "", "by area (innermost known frame):"]
    lines += [f"  {100 * c / total:5.1f}%  {a}" for a, c in by_area.most_common()]
    lines += ["", f"top {top} functions on top of the stack (self):"]
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in by_leaf.most_common(top)]
    lines += ["", f"top {top} kvgate functions (inclusive):"]
    lines += [f"  {100 * c / total:5.1f}%  {f}" for f, c in by_inclusive.most_common(top)]
    return "\n".join(lines)


def drive(url: str, *, op: str, size: int, concurrency: int, stop: threading.Event, done: list[OpStats]) -> None:
    import uvloop

    async def main() -> None:
        cfg = BenchConfig(url=url, concurrency=concurrency, block_size=size, count=2000, seed=7)
        client = AiohttpClient(base_url=url, concurrency=concurrency, timeout_s=60)
        runner = Runner(cfg, client)
        try:
            if op != "put":
                await runner.phase(runner.jobs_for("put", cfg.count), cfg.count, {"put": OpStats("put")}, lambda _: 0)
            rnd = 0
            n = 500 if size < 1024 * 1024 else 50
            while not stop.is_set():
                stats = {op: OpStats(op)}
                if op == "put":
                    runner.cfg = BenchConfig(url=url, concurrency=concurrency, block_size=size, count=n, seed=rnd)
                    rnd += 1
                await runner.phase(runner.jobs_for(op, n), n, stats, lambda _: 0)
                done.append(stats[op])
        finally:
            await client.aclose()

    uvloop.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=("put", "get", "head"), default="put")
    ap.add_argument("--size", type=int, default=64 * 1024)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--thread", help="only threads whose name starts with this (MainThread: the event loop)")
    ap.add_argument("--out", type=Path, help="keep py-spy's collapsed stacks here")
    ap.add_argument("--pyspy-flag", action="append", default=[], help="extra py-spy flag, e.g. --gil")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the gateway (repeatable)")
    args = ap.parse_args()
    pyspy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if pyspy is None:
        raise SystemExit("py-spy not found: pip install py-spy")
    work = Path(tempfile.mkdtemp(prefix="kvgate-profile-"))
    env = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false"}
    env |= dict(item.split("=", 1) for item in args.env)
    for seed in range(200):  # the keys' directories, as in a cache that has run a while (benchmarks/gateway/cost.py)
        for i in range(500):
            (work / "data" / "blocks" / bench_key(seed=seed, i=i).rsplit("/", 1)[0]).mkdir(parents=True, exist_ok=True)
    gw = Gateway(work / "data", env=env).start()
    stop = threading.Event()
    done: list[OpStats] = []
    client = threading.Thread(
        target=drive,
        kwargs={"url": gw.url, "op": args.op, "size": args.size, "concurrency": args.concurrency, "stop": stop,
                "done": done},
    )  # fmt: skip
    out = args.out or work / "stacks.txt"
    try:
        client.start()
        time.sleep(3)  # warm: connections, the first directories, the PUT phase of a read
        assert gw.proc is not None
        subprocess.run(
            [pyspy, "record", "-p", str(gw.proc.pid), "-d", str(args.seconds), "-r", str(args.rate), "-f", "raw",
             "-o", str(out), "--threads", "--nonblocking", *args.pyspy_flag],
            check=True, capture_output=True,
        )  # fmt: skip
    finally:
        stop.set()
        client.join(120)
        gw.stop()
    reqs: Any = sum(s.requests for s in done)
    print(f"{args.op} {args.size} B at c={args.concurrency}: {reqs} requests in the driven phases")
    print(summarize(out, top=args.top, thread=args.thread))
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
