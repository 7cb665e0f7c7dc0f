"""The connector's CPU per GB stored and loaded: this tree's BlockClient (CRC64NVME) against the client of an earlier
commit (sha256, the one before checksums changed), alternated in one run against one gateway.

    .venv/bin/python -m benchmarks.connector.cpu [--base 68d541f] [--blocks 64] [--block-mib 2] [--rounds 5]

Each round stores ``--blocks`` blocks with each client (PUT, concurrency 8), loads them whole (GET) and as two halves
(Range GETs, as a TP=2 reader loads a canonical block), and whole into a buffer (``get_into``, the connector's own
load path, where both clients have it), and reads the benchmark process's own CPU time around each
phase (the client's event-loop thread and the threads it hashes on; the gateway is another process). Prints each
phase's CPU per GB (median of the rounds, with the lowest and highest) and the ratio of the two clients, round by
round. The earlier client is its own source at ``--base`` (``git show``), run beside this tree's other modules.

A round runs phase by phase, each client in turn (who goes first alternates), and each client is two instances: one
stores, the other loads. A connector's loads go into its buffers; the loads here that return bytes leave 128 MiB of
freed answers in their loop thread's malloc arena, which glibc hands back lazily, at a later call in that arena: a
store on the same instance after 64 such GETs read 0.41-0.46 s/GB against 0.36 after none, so a store shares no
arena with a load.

Each round also stores ``--blocks`` blocks with :class:`FloorClient` (the same checksum and bytes on blocking
sockets, nothing else), printed as ``store, floor``: how much of a store is the kernel's and the checksum's, which
no client can cut, and so how far the connector's store could still fall.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import types
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from benchmarks.harness import key_for
from connector.http import client as this_client
from connector.http.checksums import checksum
from contract.wire import CHECKSUM_HEADER
from loopback.gateway import REPO, Gateway

BASE = "68d541f"
"""main before CRC64NVME: its client sends and checks sha256."""


def earlier_client(ref: str) -> types.ModuleType:
    source = subprocess.run(
        ["git", "show", f"{ref}:connector/http/client.py"], cwd=REPO, capture_output=True, check=True, text=True
    ).stdout
    module = types.ModuleType("connector._earlier_client")
    sys.modules[module.__name__] = module  # dataclasses look their module up there
    exec(compile(source, f"{ref}:connector/http/client.py", "exec"), module.__dict__)
    return module


def cpu_of(run: Callable[[], None]) -> tuple[float, float]:
    """(user, system) CPU seconds of this process while ``run`` runs (getrusage: microseconds, where os.times
    counted 10 ms ticks, 0.15 s/GB of 32 blocks of 2 MiB)."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    run()
    after = resource.getrusage(resource.RUSAGE_SELF)
    return after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


async def _all(coros: list[Coroutine[Any, Any, Any]], limit: int = 8) -> list[Any]:
    sem = asyncio.Semaphore(limit)

    async def one(c: Coroutine[Any, Any, Any]) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def phases_of(storer: Any, bc: Any, keys: list[str], blob: bytes, into: bytearray) -> dict[str, Callable[[], None]]:
    """The phases of one round for one client, by name: ``storer`` stores, ``bc`` (another instance of the same
    client, with a loop thread of its own) loads; ``into``: the engine's buffers, made outside the phases."""
    half = len(blob) // 2

    def store() -> None:
        assert all(storer.run(_all([storer.put(k, blob) for k in keys]), timeout_s=600))

    def load() -> None:
        got = bc.run(_all([bc.get(k) for k in keys]), timeout_s=600)
        assert all(g == blob for g in got), "a load was refused or wrong"

    def load_ranges() -> None:
        ranges = [(0, half), (half, len(blob))]
        got = bc.run(_all([bc.get(k, byte_range=r) for k in keys for r in ranges]), timeout_s=600)
        assert all(g is not None for g in got), "a range load was refused"

    def load_into() -> None:
        views = [memoryview(into)[i * len(blob) : (i + 1) * len(blob)] for i in range(len(keys))]
        got = bc.run(_all([bc.get_into(k, v) for k, v in zip(keys, views, strict=True)]), timeout_s=600)
        assert all(got) and views[-1] == blob, "a load into a buffer was refused or wrong"

    phases = {"store": store, "load": load, "load (2 ranges)": load_ranges}
    if hasattr(bc, "get_into"):
        phases["load into buffer"] = load_into
    return phases


class FloorClient:
    """The least a client can spend on a store: the same CRC64NVME, a request head and the body written with one
    ``sendmsg`` on a blocking socket (one thread per connection), the answer read to its Content-Length. No pool, no
    event loop, no retries, no parser: what is left of a store above it is the client's own; below it, the kernel's
    send of the body (on loopback, also the receiving side's TCP work, done on the sender's CPU) and the checksum."""

    def __init__(self, url: str, connections: int = 8) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.socks = [socket.create_connection((host, int(port))) for _ in range(connections)]
        for s in self.socks:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _put(self, sock: socket.socket, key: str, blob: bytes) -> None:
        head = (
            f"PUT /v1/blocks/{key} HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/octet-stream\r\n"
            f"{CHECKSUM_HEADER}: {checksum(blob).header}\r\nContent-Length: {len(blob)}\r\n\r\n"
        ).encode()
        sent = sock.sendmsg([head, blob])  # one system call, as the lean pool's writev
        if sent < len(head):
            sock.sendall(head[sent:])
        sock.sendall(memoryview(blob)[max(0, sent - len(head)) :])
        got = b""
        while b"\r\n\r\n" not in got:
            got += self._recv(sock)
        lines, _, body = got.partition(b"\r\n\r\n")
        status = lines.split(b" ", 2)[1]
        length = next(
            int(v) for k, _, v in (ln.partition(b":") for ln in lines.split(b"\r\n")) if k.lower() == b"content-length"
        )
        while len(body) < length:
            body += self._recv(sock)
        assert status in (b"200", b"201"), lines

    @staticmethod
    def _recv(sock: socket.socket) -> bytes:
        got = sock.recv(65536)
        if not got:
            raise ConnectionError("the gateway closed the connection before its answer ended")
        return got

    def store(self, keys: list[str], blob: bytes) -> None:
        n = len(self.socks)

        failed: list[BaseException] = []

        def share(i: int) -> None:
            try:
                for key in keys[i::n]:
                    self._put(self.socks[i], key, blob)
            except BaseException as exc:  # surfaces below, not in the thread's own report
                failed.append(exc)

        threads = [threading.Thread(target=share, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]

    def close(self) -> None:
        for s in self.socks:
            s.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=BASE, help="the commit whose client is the baseline")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-mib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    earlier = earlier_client(args.base)
    blob = os.urandom(int(args.block_mib * 1024 * 1024))
    with tempfile.TemporaryDirectory() as tmp:
        gw = Gateway(Path(tmp) / "data", env={"KVGATE_BACKEND__FSYNC": "false"}).start()
        try:
            # each client twice: one instance stores, one loads (see the module doc)
            clients = {
                name: tuple(module.BlockClient(module.ClientConfig(base_url=gw.url, max_connections=8)) for _ in "sl")
                for name, module in (("before", earlier), ("after", this_client))
            }
            floor = FloorClient(gw.url)
            figures: dict[str, list[dict[str, float]]] = {name: [] for name in (*clients, "floor")}
            into = bytearray(args.blocks * len(blob))  # the engine's buffers exist before a load: made outside its CPU
            into[:] = bytes(len(into))
            gb = args.blocks * len(blob) / 1e9
            for r in range(args.rounds):
                phases = {}
                for name, (storer, loader) in clients.items():
                    keys = [key_for(10_000 * r + i + (0 if name == "before" else 5_000)) for i in range(args.blocks)]
                    phases[name] = phases_of(storer, loader, keys, blob, into)
                keys = [key_for(10_000 * r + i + 2_500) for i in range(args.blocks)]
                phases["floor"] = {"store": functools.partial(floor.store, keys, blob)}
                out: dict[str, dict[str, float]] = {name: {} for name in phases}
                turns = list(phases.items())
                if r % 2:
                    turns.reverse()  # who goes first alternates
                for phase in phases["after"]:  # phase by phase, each client in turn
                    for name, runs in turns:
                        if phase in runs:
                            user, system = cpu_of(runs[phase])
                            out[name][phase] = (user + system) / gb
                            out[name][f"{phase}, user"] = user / gb
                for name, got in out.items():
                    figures[name].append(got)
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
            for pair in clients.values():
                for bc in pair:
                    bc.close()
            floor.close()
        finally:
            gw.stop()
    print(f"connector CPU per GB ({args.blocks} x {args.block_mib:g} MiB blocks, {args.rounds} rounds; load average")
    print(
        f"{os.getloadavg()[0]:.1f}); before = client of {args.base}" + (" (sha256)" if args.base == BASE else ""),
        end="",
    )
    print(", after = this tree")
    print(f"{'phase':<18} {'before s/GB':>22} {'after s/GB':>22} {'after/before':>22}")
    for phase in figures["after"][0]:
        if phase not in figures["before"][0]:
            continue  # the earlier client has no such call
        b = [f[phase] for f in figures["before"]]
        a = [f[phase] for f in figures["after"]]
        ratio = [x / y for x, y in zip(a, b, strict=True)]

        def cell(v: list[float], fmt: str = ".3f") -> str:
            return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"

        print(f"{phase:<18} {cell(b):>22} {cell(a):>22} {cell(ratio, '.2f'):>22}")
        if phase == "store":
            floors = [f[phase] for f in figures["floor"]]
            ratio = [x / y for x, y in zip(floors, b, strict=True)]
            print(f"{'store, floor':<18} {'':>22} {cell(floors):>22} {cell(ratio, '.2f'):>22}")


if __name__ == "__main__":
    main()
