"""Drivers and checks for the race tests: many clients on a few keys, every answer checked against its own ETag.

Every 2xx GET body must hash to the ETag it came with (and to ``X-KVGate-Checksum``), every 206 to its
``X-KVGate-Range-Checksum`` and to the matching slice of the body that ETag names; every HEAD's Content-Length must be
the size of the body its ETag names. At the end, HEAD, GET, lookup, ``/v1/stats`` and (on the filesystem) the files
and the SQLite rows must all agree.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import sqlite3
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import httpx

from contract.wire import parse_checksum_token
from tests.conftest import crc, crc_header, matches, token_as
from tests.gateway import Gateway

RANGE_CHECKSUM = "x-kvgate-range-checksum"
CHECKSUM = "x-kvgate-checksum"
T = TypeVar("T")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def token(data: bytes) -> str:
    """The checksum token (the ETag's) of a body PUT without a checksum header: kvgate's default, CRC64NVME."""
    return crc(data)


@dataclass
class Ledger:
    """What clients were told and what they saw wrong."""

    bodies: dict[str, bytes] = field(default_factory=dict)
    """Every body any writer sent, by its checksum token."""
    errors: list[str] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)

    def add(self, data: bytes) -> str:
        digest = token(data)
        self.bodies[digest] = data
        return digest

    def wrong(self, what: str) -> None:
        if len(self.errors) < 50:
            self.errors.append(what)


def _etag(r: httpx.Response) -> str:
    return r.headers.get("etag", "").strip('"')


async def checked_get(c: httpx.AsyncClient, key: str, ledger: Ledger, *, ranged: bool = False) -> bytes | None:
    """GET ``key`` (or a Range of it) and check the answer is one whole version; its body, or None on a 404."""
    headers = {}
    if ranged:
        a = random.randrange(0, 4096)
        headers["Range"] = f"bytes={a}-{a + random.randrange(1, 8192)}"
    r = await c.get(f"/v1/blocks/{key}", headers=headers)
    ledger.statuses[f"GET {r.status_code}"] += 1
    if r.status_code == 404:
        return None
    tag = _etag(r)
    if r.status_code == 200:
        if not matches(tag, r.content) or r.headers.get(CHECKSUM) != parse_checksum_token(tag).header:
            ledger.wrong(f"GET {key}: body {token(r.content)} under ETag {tag}")
        if int(r.headers["content-length"]) != len(r.content):
            ledger.wrong(f"GET {key}: content-length {r.headers['content-length']} for {len(r.content)} bytes")
        return r.content
    if r.status_code == 206:
        whole = ledger.bodies.get(tag)
        first, _, total = r.headers["content-range"].removeprefix("bytes ").partition("/")
        start, _, last = first.partition("-")
        if whole is None or int(total) != len(whole):
            ledger.wrong(f"Range GET {key}: ETag {tag[:12]} / total {total} names no body that was sent")
        elif whole[int(start) : int(last) + 1] != r.content or r.headers.get(RANGE_CHECKSUM) != crc_header(r.content):
            ledger.wrong(f"Range GET {key}: bytes {first} are not those of the body under ETag {tag[:12]}")
        return r.content
    if r.status_code != 416:
        ledger.wrong(f"GET {key}: unexpected {r.status_code} {r.text[:200]}")
    return None


async def checked_head(c: httpx.AsyncClient, key: str, ledger: Ledger) -> None:
    r = await c.head(f"/v1/blocks/{key}")
    ledger.statuses[f"HEAD {r.status_code}"] += 1
    if r.status_code == 200:
        body = ledger.bodies.get(_etag(r))
        if body is None or int(r.headers["content-length"]) != len(body):
            ledger.wrong(f"HEAD {key}: ETag {_etag(r)[:12]} with Content-Length {r.headers['content-length']}")
    elif r.status_code != 404:
        ledger.wrong(f"HEAD {key}: unexpected {r.status_code}")


async def readers(urls: list[str], keys: list[str], ledger: Ledger, *, n: int, stop: asyncio.Event) -> None:
    """``n`` clients reading ``keys`` (GET, Range GET, HEAD) round-robin over ``urls`` until ``stop`` is set."""

    async def one(i: int) -> None:
        async with httpx.AsyncClient(base_url=urls[i % len(urls)], timeout=30) as c:
            while not stop.is_set():
                key = random.choice(keys)
                kind = random.random()
                if kind < 0.6:
                    await checked_get(c, key, ledger)
                elif kind < 0.8:
                    await checked_get(c, key, ledger, ranged=True)
                else:
                    await checked_head(c, key, ledger)

    await asyncio.gather(*(one(i) for i in range(n)))


async def while_reading(writes: Awaitable[T], urls: list[str], keys: list[str], ledger: Ledger, *, n: int) -> T:
    """Run ``writes`` with ``n`` checking readers beside it; the readers stop when the writes are done."""
    stop = asyncio.Event()

    async def then_stop() -> T:
        try:
            return await writes
        finally:
            stop.set()

    result, _ = await asyncio.gather(then_stop(), readers(urls, keys, ledger, n=n, stop=stop))
    return result


def fs_rows(data_dir: Path) -> dict[str, tuple[int, str]]:
    with sqlite3.connect(data_dir / "index.db") as db:
        return {k: (int(s), d) for k, s, d in db.execute("select key, size, digest from blocks")}


def fs_files(data_dir: Path) -> dict[str, bytes]:
    """Every published block file's bytes (temp files, configs and part data excluded)."""
    root = data_dir / "blocks"
    found: dict[str, bytes] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if name.endswith(".bin") and not name.startswith("."):
                rel = (Path(dirpath) / name).relative_to(root).as_posix()
                if not rel.startswith("_parts/"):
                    found[rel] = (Path(dirpath) / name).read_bytes()
    return found


def assert_fs_agrees(data_dir: Path) -> dict[str, tuple[int, str]]:
    """Rows and files name the same keys, and each row's size and digest are its file's."""
    rows, files = fs_rows(data_dir), fs_files(data_dir)
    assert set(rows) == set(files), (
        f"rows without file {set(rows) - set(files)}, files without row {set(files) - set(rows)}"
    )
    bad = {k: rows[k][1] for k in rows if (len(files[k]), token_as(rows[k][1], files[k])) != rows[k]}
    assert not bad, f"row digest != its file's: {bad}"
    return rows


def assert_http_agrees(url: str, keys: list[str], ledger: Ledger) -> dict[str, str]:
    """HEAD, GET and lookup answer the same version of each key (or the same miss); key -> digest of the present."""
    present: dict[str, str] = {}
    # a connection per request: behind several workers (kvgate serve --workers), each answer may come from another
    with httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        look = c.post("/v1/lookup", json={"keys": keys})
        assert look.status_code == 200, look.text
        slots = {b["key"]: b for b in look.json()["blocks"]}
        for key in keys:
            h, g = c.head(f"/v1/blocks/{key}"), c.get(f"/v1/blocks/{key}")
            slot = slots[key]
            if g.status_code == 404:
                assert h.status_code == 404 and not slot["present"], (key, h.status_code, slot)
                continue
            assert g.status_code == 200 and h.status_code == 200, (key, g.status_code, h.status_code)
            tag = _etag(g)
            assert matches(tag, g.content) and tag == _etag(h), key
            assert tag in ledger.bodies, f"{key}: served a body that no writer sent"
            assert int(h.headers["content-length"]) == len(g.content) == slot["size"], key
            assert slot["present"] and slot["etag"].strip('"') == tag, (key, slot)
            present[key] = tag
    return present


def all_served(gw: Gateway, before: dict[int, float]) -> None:
    """Every worker of ``gw`` did a share of the work since ``before`` (``Gateway.worker_cpu``): a test run against
    several workers did exercise them all, not one while the others idled."""
    after = gw.worker_cpu()
    used = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    assert len(used) == gw.workers, (before, after)
    total = sum(used.values())
    # the kernel spreads connections over the workers' sockets by a hash of their addresses (SO_REUSEPORT): a
    # short run's split is uneven by chance (0.32 s against 0.03 s once, the machine loaded); an idle worker is 0
    assert all(u >= 0.05 * total for u in used.values()), f"CPU seconds by worker: {used}"


def assert_stats_exact(url: str, rows: dict[str, tuple[int, str]]) -> None:
    """``/v1/stats`` usage is the sum of the rows, now, without waiting for a resync."""
    stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
    assert (stats["blocks"], stats["usage_bytes"]) == (len(rows), sum(s for s, _ in rows.values())), stats
