"""PUT throughput with KV events on and off, in one run on one machine, and the events/s a subscriber receives.

    .venv/bin/python -m benchmarks.gateway.events_overhead [--count 2000] [--concurrency 16] [--block-size 4096]
        [--rounds 3] [--meta-tokens 16] [--base REV]

Starts two gateways on loopback (filesystem backend, each its own data dir): events off, and events on (ZMQ PUB and
replay sockets on loopback) with a ZMQ subscriber in this process decoding every batch. Runs ``kvgate bench``
(aiohttp, PUT phase only, new keys and bytes each round) against each in turn for ``--rounds`` rounds, interleaved,
so that load from elsewhere on the machine falls on both alike. Prints median PUT req/s of each, their ratio, and
the events the subscriber decoded per second of the PUT phases (every committed PUT is one BlockStored). Small
blocks make the request rate, and so the per-event cost, as high as it gets. ``--meta-tokens N``: every PUT (to both
gateways) carries X-KVGate-Block-Meta with N token ids and a parent, as the connectors send it. ``--base REV``: the
first gateway is revision REV's (a ``git worktree``) with events on too, so the figures are the cost of this tree's
events against REV's. CI does not run this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from app.backends import open_backends
from app.config import MemoryBackend, Settings
from app.core.versions import row_for
from app.events.publisher import Publisher
from app.events.setup import FIRST_SEQ
from app.events.wire import EventCodec, KVEventBatch, Topics
from app.events.zmq_outlet import ZmqPublisher
from app.index import BlockRecord, LogNote
from app.storage.base import Version
from benchmarks.harness import key_for
from contract.keys import parse_block_key
from loopback.gateway import REPO, Gateway, free_port


class Counter(threading.Thread):
    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self.events = 0
        self.batches = 0
        self.stop = False
        self.target = 0
        self.reached = threading.Event()

    def run(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self.stop:
            if self.sock.poll(100):
                _topic, _seq, payload = self.sock.recv_multipart()
                self.events += len(decoder.decode(payload).events)
                self.batches += 1
                if self.target and self.events >= self.target:
                    self.reached.set()
        self.sock.close(linger=0)
        self.ctx.term()


def events_on(data_dir: Path, env: dict[str, str]) -> tuple[Gateway, str]:
    """A gateway (not started) with KV events on, each socket on a port of its own; and the endpoint it publishes on."""
    pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    events = {"KVGATE_EVENTS_ENABLED": "true", "KVGATE_EVENTS_ENDPOINT": pub, "KVGATE_EVENTS_REPLAY_ENDPOINT": replay}
    return Gateway(data_dir, env={**events, **env}), pub


def cpu_seconds(gw: Gateway) -> float:
    """User + system CPU seconds of a gateway process so far (Linux /proc)."""
    assert gw.proc is not None
    fields = Path(f"/proc/{gw.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(url: str, out: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "app", "bench", "--url", url, "--quiet", "--json", str(out), "--seed", str(seed)]
    cmd += ["-c", str(args.concurrency), "-n", str(args.count), "--block-size", str(args.block_size)]
    cmd += ["--phases", "put", "--meta-tokens", str(args.meta_tokens)]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.read_text())
    if result["errors"]:
        raise SystemExit(f"bench against {url} had errors: {result['first_errors']}")
    put: dict[str, Any] = result["phases"][0]["ops"]["put"]
    return put


async def _publish(n: int, meta_tokens: int, endpoint: str | None, counter: Counter | None) -> tuple[float, float]:
    """Wall seconds and CPU seconds (this process, all threads) for the publisher to publish ``n`` events already in
    the log (a SQLite index in a temp dir; rows written by ``swap_block`` beforehand, untimed), until a subscriber
    has decoded all of them (with ``counter``)."""
    import asyncio

    with tempfile.TemporaryDirectory(prefix="kvgate-events-pub-") as tmp:
        settings = Settings(
            data_dir=Path(tmp), backend=MemoryBackend(), events_enabled=True, access_flush_interval_s=3600
        )
        async with open_backends(settings) as backends:
            index = backends.index
            await index.event_init(first_seq=FIRST_SEQ)

            def row(path: str) -> BlockRecord:
                return row_for(parse_block_key(path), Version(size=4096, digest="0" * 64), stamp=None, created_at=0.0)

            note = LogNote(token_ids=tuple(range(meta_tokens)), parent="ab" * 32) if meta_tokens else None
            for start in range(0, n, 1000):
                await asyncio.gather(
                    *(index.swap_block(row(key_for(i)), note=note) for i in range(start, min(n, start + 1000)))
                )
            zmq_pub = None
            if endpoint is not None:
                zmq_pub = ZmqPublisher(endpoint=endpoint, replay_endpoint=None, codec=EventCodec())
            codec = zmq_pub.codec if zmq_pub is not None else EventCodec()
            publisher = Publisher(index=index, codec=codec, topics=Topics(), sinks=[zmq_pub] if zmq_pub else [])
            await publisher.resume()
            if counter is not None:
                counter.target = n
                await asyncio.sleep(0.5)  # the subscriber joins
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            while await publisher.round() or publisher.behind:
                pass
            if counter is not None:
                await asyncio.to_thread(counter.reached.wait, 120)
            seconds, cpu = time.perf_counter() - start_wall, time.process_time() - start_cpu
            if publisher.published != n:
                raise SystemExit(f"published {publisher.published} of {n} events")
            if zmq_pub is not None:
                await zmq_pub.close()
            return seconds, cpu


def loop_cost_us(n: int, meta_tokens: int) -> float:
    """CPU microseconds one event costs the publishing gateway: read from the log, encoded, ordered, batched, the
    batch stored, the PUB send."""
    import asyncio

    _seconds, cpu = asyncio.run(_publish(n, meta_tokens, f"tcp://127.0.0.1:{free_port()}", None))
    return 1e6 * cpu / n


def publisher_capacity(n: int, meta_tokens: int) -> float:
    """Events/s the publisher sustains from the log to a ZMQ subscriber thread that decodes them."""
    import asyncio

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    counter = Counter(endpoint)
    counter.start()
    try:
        seconds, _cpu = asyncio.run(_publish(n, meta_tokens, endpoint, counter))
        return n / seconds
    finally:
        counter.stop = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000, help="PUTs per run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--durable", action="store_true", help="fsync and SQLite FULL (default: both off, faster)")
    parser.add_argument("--publisher-events", type=int, default=50_000, help="events for the publisher-only run")
    parser.add_argument("--meta-tokens", type=int, default=0, help="token ids in each PUT's block meta (0: none)")
    parser.add_argument("--base", help="git revision: compare its gateway with events on, instead of events off")
    args = parser.parse_args()
    fast = (
        {}
        if args.durable
        else {"KVGATE_BACKEND__KIND": "fs", "KVGATE_BACKEND__FSYNC": "false", "KVGATE_SQLITE_SYNCHRONOUS": "OFF"}
    )

    with tempfile.TemporaryDirectory(prefix="kvgate-events-bench-") as tmp:
        root = Path(tmp)
        if args.base:  # the cost of this tree's events against another revision's, both on
            base = root / "base-tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True)
            a_name, b_name = f"base {args.base}"[:11], "this tree"
            first, first_pub = events_on(root / "base", fast)
            first.cwd = base
        else:
            a_name, b_name = "events off", "events on"
            first, first_pub = Gateway(root / "off", env=fast), ""
        on, on_pub = events_on(root / "on", fast)
        figures: dict[str, list[float]] = {a_name: [], b_name: []}
        cpu: dict[str, list[float]] = {a_name: [], b_name: []}
        ratios: list[float] = []
        rates: list[float] = []
        counter = Counter(on_pub)
        other = Counter(first_pub) if args.base else None
        try:
            first.start()
            on.start()
            counter.start()
            if other is not None:
                other.start()
            for r in range(args.rounds):
                runs = [(a_name, first), (b_name, on)]
                for name, gw in runs if r % 2 == 0 else runs[::-1]:  # alternate who goes first
                    before, cpu0 = counter.events, cpu_seconds(gw)
                    put = bench(gw.url, root / f"{name}-{r}.json".replace(" ", "-"), args, seed=r)
                    cpu[name].append(1e6 * (cpu_seconds(gw) - cpu0) / args.count)
                    figures[name].append(put["req_s"])
                    if gw is on:
                        counter.target = before + args.count
                        counter.reached.wait(60)
                        got = counter.events - before
                        if got != args.count:
                            raise SystemExit(f"round {r}: the subscriber decoded {got} events for {args.count} PUTs")
                        rates.append(got / put["seconds"])
                        counter.reached.clear()
                ratios.append(figures[b_name][-1] / figures[a_name][-1])
        finally:
            counter.stop = True
            if other is not None:
                other.stop = True
            on.stop()
            first.stop()
            if args.base:
                subprocess.run(["git", "worktree", "remove", "--force", str(root / "base-tree")], cwd=REPO, check=False)

    mode = "fsync + SQLite FULL" if args.durable else "no fsync, SQLite synchronous OFF"
    print(
        f"\nkvgate PUT with KV events: {args.count} x {args.block_size} B PUTs, concurrency {args.concurrency}, "
        f"{os.cpu_count()} cores shared by client, servers and subscriber, {args.rounds} rounds (order alternating), "
        f"{mode}, {args.meta_tokens} token ids of block meta per PUT"
    )
    for name, values in figures.items():
        med = statistics.median(values)
        print(
            f"{name:<11} PUT req/s {med:8.0f} ({min(values):.0f}-{max(values):.0f})  "
            f"gateway CPU per PUT {statistics.median(cpu[name]):6.0f} us"
        )
    print(
        f"PUT req/s {b_name} / {a_name}, median of the rounds' ratios: {statistics.median(ratios):.3f} {sorted(ratios)}"
    )
    cost = statistics.median(cpu[b_name]) - statistics.median(cpu[a_name])
    print(f"gateway CPU per PUT {b_name} - {a_name}: {cost:.0f} us")
    print(f"events decoded by a ZMQ subscriber: {statistics.median(rates):.0f}/s (median of rounds), none missing")
    capacity = publisher_capacity(args.publisher_events, args.meta_tokens)
    print(f"publisher alone (log -> batches stored -> ZMQ, a subscriber decoding): {capacity:.0f} events/s")
    cost_us = loop_cost_us(args.publisher_events, args.meta_tokens)
    print(f"CPU per event published (log read, encode, order, batch stored, PUB send): {cost_us:.1f} us")


if __name__ == "__main__":
    main()
