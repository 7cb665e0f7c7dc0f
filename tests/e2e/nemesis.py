"""The history checker's nemesis: faults injected at random beside the traffic of ``tests/e2e/history.py``, each
kind counted. The gateway kills (``Faults``) and ``kvgate gc`` kills (``Tools``) live in ``history_runs``; here:

- ``rot``: a stored block file has a bit flipped or is truncated in place, its mtime put back (as bit rot leaves a
  file: its stamp still the row's); for replicas, a stored S3 object rewritten so, its metadata kept. The key is
  marked corrupted in the history: from then on it may be a miss, but a body served under an ETag must still be
  that ETag's (a 200 whose bytes do not match its ETag is counted as detected by the client; a body matching an
  ETag nobody wrote is a problem); an acknowledged write of the key that began after the change ends the
  exemption;
- ``pg``: through ``tests/pg_proxy.py`` in front of PostgreSQL, bursts of lost COMMIT replies (the server commits,
  the answer is dropped) and partitions (every connection cut, new ones refused for a second or so);
- ``s3``: through ``tests/tcp_faults.py`` in front of the S3-compatible server, bursts of requests cut before or in
  the middle of their body, of replies lost after the server did the request (an object stored, the gateway not
  told), and partitions;
- ``coord``: the data directory's coordination file (``kvgate.coord``: key locks, cache epochs) removed under the
  running gateway and tools: each must notice, refuse its changes (503, or a tool's error) and, the gateway,
  restart itself (it is started again, as a service manager would), never go on without it;
- ``clock``: every process started (gateway, ``kvgate gc``, ``kvgate import``) runs with its own clock offset, drawn
  from ±30 minutes (±10 for replicas: S3 refuses a request signed 15 minutes off), with libfaketime, as on hosts
  whose clocks disagree: no decision may depend on two of them.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from loopback.s3_servers import S3TestServer
from tests.e2e.history import History
from tests.pg_proxy import PgFaultProxy
from tests.tcp_faults import TcpFaultProxy

KINDS = ("kill9", "workers", "points", "gc", "rot", "pg", "s3", "clock", "coord")
"""Fault kinds: gateway kill -9 (with ``workers``: a gateway of two ``--workers``, and half the kills of one of
its workers, which its supervisor replaces), some of them aimed at a named crash point drawn at each gateway start
from the whole table (``CRASH_POINTS`` in tests/e2e/faults/sitecustomize.py: every step of a key's versions, of
upkeep and of start-up reconcile; filesystem scenario, with ``kill9``; each point reached counted by name),
``kvgate gc`` and ``kvgate import`` kill -9,
bit rot in block files, PostgreSQL faults, S3 network faults, clock offsets per process, the coordination file
removed under running processes (filesystem scenario)."""

CLOCK_OFFSET_S = 30 * 60


def libfaketime() -> str | None:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


@dataclass
class Clocks:
    """Environments that give each process started its own clock, ``offset_s`` either side of this host's (libfaketime:
    the wall clock and the monotonic one move by a constant); each one drawn is counted."""

    rng: random.Random
    counts: Counter[str]
    offset_s: int = CLOCK_OFFSET_S

    def env(self) -> dict[str, str]:
        lib = libfaketime()
        if lib is None:
            raise RuntimeError("libfaketime not installed (apt-get install -y faketime)")
        offset = self.rng.randint(-self.offset_s, self.offset_s)
        self.counts[f"clock offset (a process started off by up to {self.offset_s // 60} min)"] += 1
        return {"LD_PRELOAD": lib, "FAKETIME": f"{offset:+d}", "FAKETIME_DONT_RESET": "1"}


def parse_kinds(spec: str) -> frozenset[str]:
    """``all``, ``none`` or a comma list of :data:`KINDS`."""
    if spec == "all":
        return frozenset(KINDS)
    if spec == "none":
        return frozenset()
    kinds = frozenset(s.strip() for s in spec.split(",") if s.strip())
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return kinds


@dataclass
class Rot:
    """Bit flips and truncations of published block files under ``blocks``, at random, until stopped."""

    blocks: Path
    history: History
    rng: random.Random
    counts: Counter[str]
    every_s: tuple[float, float] = (2.0, 6.0)
    intensity: float = 1.0
    """The waits between faults divided by this (``--intensity``)."""
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every_s) / self.intensity):
            try:
                files = sorted(
                    p
                    for p in self.blocks.rglob("*.bin")
                    if not p.name.startswith(".") and "_parts" not in p.relative_to(self.blocks).parts
                )
            except FileNotFoundError:  # a directory swept while walked (gc removes empty ones): walk again later
                continue
            if files:
                self._corrupt(self.rng.choice(files))

    def _corrupt(self, path: Path) -> None:
        key = path.relative_to(self.blocks).as_posix()
        span = self.history.corrupt(key)  # before the bytes change: a read that sees them comes after
        try:
            st = path.stat()
            if st.st_size == 0:
                return
            if self.rng.random() < 0.6:
                at = self.rng.randrange(st.st_size)
                with open(path, "r+b") as f:
                    f.seek(at)
                    byte = f.read(1)[0]
                    f.seek(at)
                    f.write(bytes([byte ^ (1 << self.rng.randrange(8))]))
                kind = "bit flip"
            else:
                os.truncate(path, self.rng.randrange(st.st_size))
                kind = "truncation"
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        except (FileNotFoundError, IndexError):
            return  # replaced or removed meanwhile
        finally:
            span[1] = time.monotonic()
        self.counts[kind] += 1


@dataclass
class PgFaults:
    """Lost COMMIT replies in bursts and short partitions of PostgreSQL, through ``proxy``, until stopped."""

    proxy: PgFaultProxy
    rng: random.Random
    counts: Counter[str]
    every_s: tuple[float, float] = (1.0, 3.0)
    intensity: float = 1.0
    """The waits between bursts and the bursts' lengths divided by this (``--intensity``): as many more bursts
    and partitions, PostgreSQL out of reach for the same share of the time."""
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        k = self.intensity
        while not self.stop.wait(self.rng.uniform(*self.every_s) / k):
            if self.rng.random() < 0.6:
                self.proxy.lose_rate = 0.3
                self.stop.wait(self.rng.uniform(0.5, 1.5) / k)
                self.proxy.lose_rate = 0.0
            else:
                self.proxy.cut()
                self.counts["pg partition"] += 1
                self.stop.wait(self.rng.uniform(0.3, 1.5) / k)
                self.proxy.heal()
        self.proxy.lose_rate = 0.0
        self.proxy.heal()
        self.counts["pg lost COMMIT reply"] = self.proxy.lost


@dataclass
class S3Faults:
    """Requests cut, replies lost and partitions of the S3-compatible server, through ``proxy``, until stopped."""

    proxy: TcpFaultProxy
    rng: random.Random
    counts: Counter[str]
    every_s: tuple[float, float] = (1.0, 3.0)
    intensity: float = 1.0
    """As ``PgFaults.intensity``."""
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        k = self.intensity
        while not self.stop.wait(self.rng.uniform(*self.every_s) / k):
            roll = self.rng.random()
            if roll < 0.4:
                self.proxy.lose_reply_rate = 0.2
            elif roll < 0.8:
                self.proxy.cut_request_rate = 0.1
            else:
                self.proxy.cut()
            self.stop.wait(self.rng.uniform(0.3, 1.5) / k)
            self.proxy.lose_reply_rate = self.proxy.cut_request_rate = 0.0
            self.proxy.heal()
        self.proxy.lose_reply_rate = self.proxy.cut_request_rate = 0.0
        self.proxy.heal()
        self.counts["s3 request cut (before or mid-body)"] = self.proxy.cut_requests
        self.counts["s3 reply lost (request done)"] = self.proxy.lost_replies
        self.counts["s3 partition"] = self.proxy.partitions


@dataclass
class S3Rot:
    """Bit flips and truncations of stored block objects, at random, until stopped: an object is read, changed and
    written back under its own name with its own metadata (the gateway's recorded checksum), behind the gateways'
    backs. Marked in the history as ``Rot`` marks files."""

    s3: S3TestServer
    bucket: str
    prefix: str
    history: History
    rng: random.Random
    counts: Counter[str]
    every_s: tuple[float, float] = (2.0, 6.0)
    intensity: float = 1.0
    """As ``Rot.intensity``."""
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every_s) / self.intensity):
            asyncio.run(self._once())

    async def _once(self) -> None:
        async with self.s3.client() as s3:
            listed = await s3.list_objects_v2(Bucket=self.bucket, Prefix=f"{self.prefix}/")
            names = sorted(
                o["Key"] for o in listed.get("Contents", []) if ".bin.v" in o["Key"] and "_parts" not in o["Key"]
            )
            if not names:
                return
            name = self.rng.choice(names)
            key = name[len(self.prefix) + 1 : name.rindex(".v")]
            span = self.history.corrupt(key)  # before the bytes change: a read that sees them comes after
            try:
                got = await s3.get_object(Bucket=self.bucket, Key=name)
                data = bytearray(await got["Body"].read())
                if not data:
                    return
                if self.rng.random() < 0.6:
                    data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
                    kind = "S3 object bit flip"
                else:
                    del data[self.rng.randrange(len(data)) :]
                    kind = "S3 object truncation"
                await s3.put_object(Bucket=self.bucket, Key=name, Body=bytes(data), Metadata=got.get("Metadata", {}))
            except Exception:
                return  # removed or replaced meanwhile
            finally:
                span[1] = time.monotonic()
            self.counts[kind] += 1
