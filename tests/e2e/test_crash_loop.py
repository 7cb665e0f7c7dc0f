"""kill -9 loop: overwrites, multi-part objects and eviction, killed at a random moment, 10 cycles.

After each restart: every row's digest is its file's checksum (and rows and files name the same keys); every
key holds its last acknowledged version or the one in flight when the gateway died, never an older or an unsent
one; every acknowledged write is there on the cycles without a capacity bound (eviction may remove blocks on the
others); and nothing that was answered with an error is there. With one gateway process (10 cycles) and with two
workers, supervisor and workers killed at once (4 cycles: each start of two workers takes longer).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import crc, key_for, matches, random_bytes
from tests.e2e.races import assert_fs_agrees, fs_files
from tests.gateway import Gateway

BLOCK = 32 * 1024
CYCLES = 10
OVERWRITTEN = [key_for(50_000 + i) for i in range(24)]
PARTED = [key_for(60_000 + i) for i in range(400)]


@dataclass
class KeyLog:
    acked: str | None = None
    """Digest of the last acknowledged PUT (each key has one writer at a time, so 'last' is well defined)."""
    in_flight: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    acks: int = 0


async def _put(c: httpx.AsyncClient, key: str, data: bytes, log: KeyLog, headers: dict[str, str] | None = None) -> int:
    digest = crc(data)
    log.in_flight.add(digest)
    try:
        r = await c.put(f"/v1/blocks/{key}", content=data, headers=headers or {})
    except httpx.HTTPError:
        return 0  # killed mid-request: stays in flight
    log.in_flight.discard(digest)
    if r.status_code in (200, 201):
        log.acked = digest
        log.acks += 1
    elif r.status_code != 202:
        log.failed.add(digest)
    return r.status_code


async def _load(url: str, logs: dict[str, KeyLog], cycle: int, stop: threading.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=20) as c:

        async def overwriter(w: int) -> None:  # each key has one writer: its history is a sequence
            mine = OVERWRITTEN[w::4]
            n = 0
            while not stop.is_set():
                key = mine[n % len(mine)]
                n += 1
                if await _put(c, key, random_bytes(BLOCK, cycle * 1_000_000 + w * 10_000 + n), logs[key]) == 0:
                    return

        async def parter() -> None:  # objects as two Content-Range parts; acknowledged when the second completes
            for i in range(cycle * 40, cycle * 40 + 40):
                if stop.is_set():
                    return
                key = PARTED[i]
                data = random_bytes(BLOCK, 7_000_000 + i)
                half, log = BLOCK // 2, logs[key]
                log.in_flight.add(crc(data))
                for a, b in ((0, half), (half, BLOCK)):
                    rng = {"Content-Range": f"bytes {a}-{b - 1}/{BLOCK}"}
                    try:
                        r = await c.put(f"/v1/blocks/{key}", content=data[a:b], headers=rng)
                    except httpx.HTTPError:
                        return
                    if r.status_code not in (201, 202):
                        log.failed.add(crc(data))
                        break
                    if r.status_code == 201:
                        log.in_flight.discard(crc(data))
                        log.acked = crc(data)
                        log.acks += 1

        async def reader() -> None:
            while not stop.is_set():
                try:
                    r = await c.get(f"/v1/blocks/{random.choice(OVERWRITTEN)}")
                except httpx.HTTPError:
                    return
                if r.status_code == 200:
                    assert matches(r.headers["etag"], r.content)

        await asyncio.gather(*(overwriter(w) for w in range(4)), parter(), reader())


@pytest.mark.parametrize(("workers", "cycles"), [(1, CYCLES), (2, 4)], ids=["1-worker", "2-workers"])
def test_kill9_loop_keeps_one_version_per_key(tmp_path: Path, workers: int, cycles: int) -> None:
    logs = {k: KeyLog() for k in [*OVERWRITTEN, *PARTED]}
    data_dir = tmp_path / "data"
    evicting = {"KVGATE_MAX_BYTES": str(40 * BLOCK), "KVGATE_EVICTION_INTERVAL_S": "0.1"}
    gw: Gateway | None = None
    evicted = False
    for cycle in range(cycles):
        # recovery is checked on an unbounded gateway (nothing is evicted while the files are compared)
        gw = Gateway(data_dir, port=gw.port if gw else None, workers=workers).start()
        _check_after_restart(gw, logs, evicted=evicted)
        evicted = cycle % 2 == 1
        if evicted:
            gw.stop()
            gw = Gateway(data_dir, env=evicting, port=gw.port, workers=workers).start()
        stop = threading.Event()
        t = threading.Thread(target=asyncio.run, args=(_load(gw.url, logs, cycle, stop),))
        t.start()
        time.sleep(random.uniform(0.5, 1.5))
        gw.kill9()
        stop.set()
        t.join(60)
        assert not t.is_alive()
    assert gw is not None
    gw = Gateway(data_dir, port=gw.port, workers=workers).start()
    try:
        _check_after_restart(gw, logs, evicted=evicted)
        assert sum(log.acks for log in logs.values()) > 50
    finally:
        gw.stop()


def _check_after_restart(gw: Gateway, logs: dict[str, KeyLog], *, evicted: bool) -> None:
    rows = assert_fs_agrees(gw.data_dir)  # every row's digest is its file's checksum; no row without file
    assert not [p for p in (gw.data_dir / "blocks").rglob(".kvgate-tmp-*")]
    assert set(fs_files(gw.data_dir)) == set(rows)
    for key, log in logs.items():
        row = rows.get(key)
        allowed = log.in_flight | ({log.acked} if log.acked else set())
        if row is None:
            # a miss is allowed where the bound made the gateway evict, or where nothing was ever acknowledged
            assert evicted or log.acked is None, f"acknowledged {key} lost"
            log.acked, log.in_flight = None, set()
            continue
        assert row[1] in allowed, f"{key} holds {row[1][:12]}, neither its last acknowledged version nor in flight"
        assert row[1] not in log.failed, f"{key} holds a version whose PUT was refused"
        log.in_flight = {row[1]} & log.in_flight  # what landed is now its version; the rest never will
        if row[1] != log.acked:
            log.acked = row[1]  # an in-flight write that landed is now the key's last version
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        stats = c.get("/v1/stats").json()
        assert stats["blocks"] == len(rows)
