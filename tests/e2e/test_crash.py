"""kill -9 in the middle of a stream of concurrent PUTs: every acknowledged PUT survives byte-identical (one
gateway process, and two workers with their supervisor killed at once)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import crc, key_for, random_bytes
from tests.gateway import Gateway

BLOCK = 512 * 1024


async def _writer(url: str, ids: list[int], acked: dict[str, str], stop: threading.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=10) as c:
        for i in ids:
            if stop.is_set():
                return
            data = random_bytes(BLOCK, i)
            try:
                r = await c.put(f"/v1/blocks/{key_for(i)}", content=data)
            except httpx.HTTPError:
                return
            if r.status_code in (200, 201):
                acked[key_for(i)] = crc(data)


@pytest.mark.parametrize("workers", [1, 2], ids=["1-worker", "2-workers"])
def test_kill9_mid_stream(tmp_path: Path, workers: int) -> None:
    gw = Gateway(tmp_path / "data", workers=workers).start()
    acked: dict[str, str] = {}
    stop = threading.Event()

    async def load() -> None:
        await asyncio.gather(*(_writer(gw.url, list(range(w, 4000, 16)), acked, stop) for w in range(16)))

    t = threading.Thread(target=lambda: asyncio.run(load()))
    t.start()
    deadline = time.monotonic() + 30
    while len(acked) < 60 and time.monotonic() < deadline:
        time.sleep(0.05)
    gw.kill9()  # mid-stream: 16 writers have requests in flight
    stop.set()
    t.join(30)
    assert len(acked) >= 60

    gw.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, digest in acked.items():
                r = c.get(f"/v1/blocks/{key}")
                assert r.status_code == 200, key
                assert crc(r.content) == digest
                assert r.headers["etag"] == f'"{digest}"'
        root = gw.data_dir / "blocks"
        files = {str(p.relative_to(root)) for p in root.rglob("*.bin")}
        temps = [p for p in root.rglob(".kvgate-tmp-*")]
        with sqlite3.connect(gw.data_dir / "index.db") as db:
            rows = {k: (s, d) for k, s, d in db.execute("select key, size, digest from blocks")}
        # every row has its file; acknowledged ones are all there
        assert set(acked) <= set(rows)
        assert set(rows) <= files
        for key in rows:
            assert (root / key).stat().st_size == rows[key][0]
        # files without a row are the in-flight PUTs that were never acknowledged (reconcile adopts them)
        assert not (set(acked) - files)
        assert all(not t.name.endswith(".bin") for t in temps)
    finally:
        gw.stop()
