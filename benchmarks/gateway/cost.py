"""The cost of a request: server CPU per request, kvgate next to nginx (WebDAV) on the same work, in one run.

    .venv/bin/python -m benchmarks.gateway.cost                # PUT, GET at 64 KiB and 2 MiB, HEAD; c=16; 3 rounds
    .venv/bin/python -m benchmarks.gateway.cost --base 5a2c15d # and kvgate at another revision beside it
    .venv/bin/python -m benchmarks.gateway.cost --workers-compare 1 2 -c 32   # kvgate with 1 worker against 2
    .venv/bin/python -m benchmarks.gateway.cost --env-compare KVGATE_PUT_LANE=false   # and kvgate with these settings

The figure is the **server's CPU time per request**: each server's processes (nginx's master and worker; kvgate's
process, or its supervisor and every worker) are read from ``/proc`` just before and just after each phase, with
nanosecond process CPU clocks (``clock_gettime`` on the process's CPU clock id: every thread, live or gone). The
client is independent of both servers: one aiohttp client in this process (``kvgate bench``'s runner: every GET
body is checked against the sha256 of what was PUT), driven at the given concurrency. Neither server fsyncs blocks
(nginx's WebDAV never does: kvgate runs with ``KVGATE_BACKEND__FSYNC=false``; its index commits stay durable).
nginx runs one worker, kvgate one process (unless ``--workers``).

**The page cache is not primed** (``--prime``: it is, before each PUT phase: the client writes and unlinks a
scratch file as large as the phase's bodies, so that every server's writes land in pages the kernel has just freed).
On a VM whose freed memory goes back to the host (virtio-balloon free page reporting, as here), a write that grows
the page cache into memory the host took back costs several times one into pages it still backs, and the cost
moves with the memory's state: whichever server happens to grow the cache pays it. The unprimed figure is what a
user sees on such a VM (cloud VMs are where gateways run); the primed one is a storage node whose cache is full.
Beside the CPU, the report gives the server's minor page faults per request (memory new to the process, touched for
the first time) and the kernel's share of its CPU.

Each round runs every system in turn (the order rotates), each phase on fresh keys; the report gives each cell's
median over the rounds with its lowest and highest, and the kvgate/nginx ratio taken round by round (the same
round's nginx figure), then its median. The machine is shared: the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.tools.bench import BenchConfig, OpStats, Runner, bench_key
from app.tools.bench_clients import AiohttpClient
from benchmarks.gateway.compare import Nginx
from loopback.gateway import REPO, Gateway

KiB = 1024
MiB = 1024 * KiB
SIZES = (64 * KiB, 2 * MiB)
COUNTS = {64 * KiB: 3000, 2 * MiB: 300}
"""Requests per PUT and GET phase, by block size (enough server CPU that a phase spans many scheduler ticks)."""
HEADS = 6000


def cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (Linux: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED))."""
    return ((~pid) << 3) | 2


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by these processes (all their threads, including threads that have ended)."""
    total = 0.0
    for pid in pids:
        try:
            total += time.clock_gettime(cpu_clock(pid))
        except OSError:  # the process is gone
            continue
    return total


def faults_and_system(pids: list[int]) -> tuple[int, float]:
    """Minor page faults so far (memory new to the process touched for the first time: each one a page the kernel
    had to find, zero and map) and system CPU seconds, over these processes and all their threads."""
    faults, system = 0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        faults += int(fields[7])  # minflt (field 10 of stat; 8 after the command)
        system += int(fields[12]) / tick  # stime
    return faults, system


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a supervisor and its workers)."""
    out = [pid]
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return out
    for kid in kids:
        out.extend(process_tree(int(kid)))
    return out


@dataclass
class System:
    name: str
    url: str
    target: str
    root_pid: int
    stop: Any
    root: Path
    """Where its block files go (the key's path under it)."""

    def pids(self) -> list[int]:
        return process_tree(self.root_pid)


@dataclass
class Cell:
    """One (system, op, size) over the rounds."""

    cpu_ms: list[float] = field(default_factory=list)
    faults: list[float] = field(default_factory=list)
    """Minor page faults per request."""
    system: list[float] = field(default_factory=list)
    """The kernel's share of the CPU time."""
    req_s: list[float] = field(default_factory=list)
    mb_s: list[float] = field(default_factory=list)
    ratio: list[float] = field(default_factory=list)
    """CPU per request against the reference system of the same round."""


@dataclass
class Phase:
    stats: OpStats
    cpu_ms: float
    """Server CPU per request."""
    faults: float
    """Server minor page faults per request."""
    system: float
    """The kernel's share of the server's CPU."""


async def run_phase(runner: Runner, op: str, n: int, pids: list[int]) -> Phase:
    stats = {op: OpStats(op=op)}
    before, (faults0, sys0) = cpu_seconds(pids), faults_and_system(pids)
    await runner.phase(runner.jobs_for(op, n), n, stats, lambda _n: None)
    used = cpu_seconds(pids) - before
    faults1, sys1 = faults_and_system(pids)
    s = stats[op]
    if s.errors or s.verify_failures or s.misses:
        raise RuntimeError(f"{op}: {s.errors} errors, {s.verify_failures} wrong bodies, {s.misses} misses: "
                           f"{runner.first_errors}")  # fmt: skip
    n_req = max(1, s.requests)
    return Phase(s, 1000 * used / n_req, (faults1 - faults0) / n_req, (sys1 - sys0) / used if used > 0 else 0.0)


def prime_page_cache(root: Path, *, nbytes: int, piece: int = 4 * MiB) -> None:
    """Write ``nbytes`` to a scratch file under ``root`` and unlink it: the kernel then holds that many freed pages
    that the host still backs (see the module docstring)."""
    root.mkdir(parents=True, exist_ok=True)
    scratch = root / ".prime"
    data = os.urandom(piece)
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(-(-nbytes // piece)):
            os.write(fd, data)
    finally:
        os.close(fd)
        scratch.unlink()


async def run_system(
    system: System,
    *,
    size: int,
    concurrency: int,
    seed: int,
    n: int,
    heads: int,
    ops: str = "put,get,head",
    prime: bool = False,
) -> dict[str, Phase]:
    cfg = BenchConfig(
        url=system.url, target=system.target, concurrency=concurrency, block_size=size, count=n,  # type: ignore[arg-type]
        phases="put,get,head", seed=seed,
    )  # fmt: skip
    client = AiohttpClient(base_url=system.url, concurrency=concurrency, timeout_s=120.0)
    runner = Runner(cfg, client)
    out: dict[str, Phase] = {}
    try:
        pids = system.pids()
        for op, count in (("put", n), ("get", n), ("head", heads)):
            if count and op in ops.split(","):
                if op == "put" and prime:
                    prime_page_cache(system.root, nbytes=count * size)
                out[op] = await run_phase(runner, op, count, pids)
    finally:
        await client.aclose()
    return out


def start_gateway(
    work: Path, name: str, *, workers: int, repo: Path = REPO, extra: dict[str, str] | None = None
) -> System:
    (work / name).mkdir()
    env = {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false", **(extra or {})}
    gw = Gateway(work / name / "data", env=env, repo=repo, workers=workers).start()  # every worker ready
    if gw.proc is None:
        raise RuntimeError("gateway did not start")
    return System(
        name=name, url=gw.url, target="kvgate", root_pid=gw.proc.pid, stop=gw.stop, root=work / name / "data" / "blocks"
    )


def _run(coro: Any) -> Any:
    import uvloop

    return uvloop.run(coro)


def make_dirs(systems: list[System], *, seeds: list[tuple[int, int]]) -> None:
    """The directories of every key the run will PUT, made beforehand on every system's root: a cache that has run
    a while has its ``<hhh>/<hh>_g<group>`` directories (4096 x 256 of them), so a PUT creates its file alone."""
    for seed, n in seeds:
        for i in range(n):
            parent = bench_key(seed=seed, i=i).rsplit("/", 1)[0]
            for s in systems:
                (s.root / parent).mkdir(parents=True, exist_ok=True)


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def row_label(op: str, size: int) -> str:
    """A report row's name: ``PUT 64 KiB``, ``GET 2 MiB``, ``HEAD``."""
    if op == "head":
        return "HEAD"
    return f"{op.upper()} {size // MiB} MiB" if size >= MiB else f"{op.upper()} {size // KiB} KiB"


def fmt_cell(values: list[float], spec: str) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-c", "--concurrency", type=int, default=16)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="block sizes in bytes")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply the request counts")
    ap.add_argument("--base", help="also run kvgate at this git revision (a temporary worktree)")
    ap.add_argument("--workers", type=int, default=1, help="kvgate worker processes")
    ap.add_argument("--workers-compare", type=int, nargs="+", metavar="N",
                    help="no nginx: kvgate with each of these worker counts, side by side")  # fmt: skip
    ap.add_argument("--ops", default="put,get,head", help="which of put,get,head to run (get and head need put)")
    ap.add_argument("--no-nginx", action="store_true")
    ap.add_argument("--env-compare", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                    help="also run kvgate with these environment variables (repeatable)")  # fmt: skip
    ap.add_argument(
        "--fresh-dirs", action="store_true", help="do not make the keys' directories beforehand (PUTs make them)"
    )
    ap.add_argument("--prime", action="store_true", help="prime the page cache before each PUT phase")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvgate-cost-"))
    base_tree: Path | None = None
    systems: list[System] = []
    try:
        if args.workers_compare:
            for w in args.workers_compare:
                systems.append(start_gateway(work, f"kvgate-w{w}", workers=w))
        else:
            if not args.no_nginx:
                nginx = Nginx(work / "nginx").start()
                if nginx.proc is None:
                    raise RuntimeError("nginx did not start")
                systems.append(System("nginx", nginx.url, "webdav", nginx.proc.pid, nginx.stop, nginx.work / "root"))
            if args.base:
                base_tree = work / "base-tree"
                subprocess.run(["git", "worktree", "add", "--detach", str(base_tree), args.base], cwd=REPO,
                               check=True, capture_output=True)  # fmt: skip
                systems.append(start_gateway(work, f"kvgate@{args.base}", workers=1, repo=base_tree))
            systems.append(start_gateway(work, "kvgate", workers=args.workers))
            for i, spec in enumerate(args.env_compare):
                extra = dict(item.split("=", 1) for item in spec.split(","))
                systems.append(start_gateway(work, f"kvgate+env{i + 1}", workers=args.workers, extra=extra))
                print(f"kvgate+env{i + 1}: {spec}")
        plan = [(1000 * rnd + size % 997, max(16, int(COUNTS.get(size, 300) * args.scale)))
                for rnd in range(args.rounds) for size in args.sizes]  # fmt: skip
        if not args.fresh_dirs:
            make_dirs(systems, seeds=plan)
        cells: dict[tuple[str, str, int], Cell] = {}
        loads = [load_average()]
        # a warm-up pass, not recorded: first connections, first files and directories, SQLite's first pages
        for s in systems:
            _run(run_system(s, size=64 * KiB, concurrency=args.concurrency, seed=999_999, n=200, heads=200))
        for rnd in range(args.rounds):
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for size in args.sizes:
                n = max(16, int(COUNTS.get(size, 300) * args.scale))
                heads = int(HEADS * args.scale) if size == min(args.sizes) else 0
                got: dict[str, dict[str, Phase]] = {}
                for s in order:
                    seed = 1000 * rnd + size % 997
                    print(f"  round {rnd + 1}/{args.rounds} {s.name:>18} {size // KiB:>5} KiB ...", flush=True)
                    got[s.name] = _run(
                        run_system(
                            s,
                            size=size,
                            concurrency=args.concurrency,
                            seed=seed,
                            n=n,
                            heads=heads,
                            ops=args.ops,
                            prime=args.prime,
                        )
                    )
                ref = systems[0].name
                for name, ops in got.items():
                    for op, phase in ops.items():
                        cell = cells.setdefault((name, op, size), Cell())
                        cell.cpu_ms.append(phase.cpu_ms)
                        cell.faults.append(phase.faults)
                        cell.system.append(phase.system)
                        cell.req_s.append(phase.stats.req_s)
                        cell.mb_s.append(phase.stats.mb_s)
                        cell.ratio.append(phase.cpu_ms / got[ref][op].cpu_ms)
            loads.append(load_average())
    finally:
        for s in reversed(systems):
            s.stop()
        if base_tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=REPO, check=False,
                           capture_output=True)  # fmt: skip
        shutil.rmtree(work, ignore_errors=True)
    report(systems=[s.name for s in systems], cells=cells, args=args, loads=loads)


def report(
    *, systems: list[str], cells: dict[tuple[str, str, int], Cell], args: argparse.Namespace, loads: list[str]
) -> None:
    ref = systems[0]
    print(
        f"\nserver CPU per request, ms: median (lowest-highest) of {args.rounds} rounds; concurrency "
        f"{args.concurrency}; {os.cpu_count()} cores shared by client and servers; load average (1, 5, 15 min) "
        f"at each round's end: {' | '.join(loads)}; page cache "
        + ("primed before each PUT phase" if args.prime else "not primed")
    )
    rows = [(op, size) for size in args.sizes for op in ("put", "get", "head") if (ref, op, size) in cells]
    head = (
        f"{'request':<14}"
        + "".join(f"{s:>26}" for s in systems)
        + "".join(f"{s + ' / ' + ref:>26}" for s in systems[1:])
    )
    print(head)
    for op, size in rows:
        line = f"{row_label(op, size):<14}"
        for s in systems:
            line += f"{fmt_cell(cells[(s, op, size)].cpu_ms, '.3f'):>26}"
        for s in systems[1:]:
            line += f"{fmt_cell(cells[(s, op, size)].ratio, '.2f'):>26}"
        print(line)
    print("\nthroughput, requests per second (median, lowest-highest):")
    print(f"{'request':<14}" + "".join(f"{s:>26}" for s in systems))
    for op, size in rows:
        print(
            f"{row_label(op, size):<14}"
            + "".join(f"{fmt_cell(cells[(s, op, size)].req_s, '.0f'):>26}" for s in systems)
        )
    print("\nthroughput, MB/s (median, lowest-highest):")
    print(f"{'request':<14}" + "".join(f"{s:>26}" for s in systems))
    for op, size in rows:
        if op != "head":
            print(
                f"{row_label(op, size):<14}"
                + "".join(f"{fmt_cell(cells[(s, op, size)].mb_s, '.0f'):>26}" for s in systems)
            )
    print("\nserver minor page faults per request (new memory touched), and the kernel's share of its CPU:")
    print(f"{'request':<14}" + "".join(f"{s:>26}" for s in systems))
    for op, size in rows:
        line = f"{row_label(op, size):<14}"
        for s in systems:
            c = cells[(s, op, size)]
            line += f"{statistics.median(c.faults):>14.1f} / {100 * statistics.median(c.system):>6.0f}% sys"
        print(line)
    if args.json:
        out = {
            "command": " ".join(["python -m benchmarks.gateway.cost", *sys.argv[1:]]),
            "cores": os.cpu_count(),
            "load_average": loads,
            "cells": [{"system": s, "op": op, "size": size, **vars(c)} for (s, op, size), c in sorted(cells.items())],
        }
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
