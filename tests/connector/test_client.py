"""BlockClient against a real gateway: integrity, misses vs outages, bounded bytes in flight, retries."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from connector.http.client import BlockClient, ClientConfig, GatewayUnavailable
from tests.conftest import crc, key_for, random_bytes
from tests.gateway import Gateway, free_port


@pytest.fixture
def bc(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url, max_connections=8)) as c:
        yield c


def test_put_get_round_trip_and_range(bc: BlockClient) -> None:
    key, blob = key_for(1), random_bytes(3 * 1024 * 1024 + 7, seed=1)
    assert bc.run(bc.put(key, memoryview(blob)))
    assert bc.run(bc.get(key)) == blob
    assert bc.run(bc.get(key, byte_range=(1000, 5000))) == blob[1000:5000]
    assert bc.run(bc.head(key)) == len(blob)
    assert bc.stats.puts == 1 and bc.stats.put_bytes == len(blob)


def test_miss_is_none(bc: BlockClient) -> None:
    assert bc.run(bc.get(key_for(2))) is None
    assert bc.run(bc.head(key_for(2))) is None
    assert bc.stats.misses == 1 and bc.stats.corrupt_reads == 0


def test_lookup_one_round_trip(bc: BlockClient) -> None:
    keys = [key_for(i) for i in range(10, 15)]
    for k in keys[:3]:
        bc.run(bc.put(k, b"abc"))
    prefix, slots = bc.run(bc.lookup([*keys[:2], keys[4], keys[2]]))
    assert prefix == 2
    assert [s.present for s in slots] == [True, True, False, True]
    assert slots[0].digest == crc(b"abc") and slots[0].size == 3


def test_corrupt_file_is_a_miss_not_data(bc: BlockClient, gateway: Gateway) -> None:
    # bit rot: the bytes change in place, inode and mtime stay (the gateway's version stamp cannot see it)
    key, blob = key_for(3), random_bytes(64 * 1024, seed=3)
    bc.run(bc.put(key, blob))
    path = gateway.data_dir / "blocks" / key
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(100)
        f.write(bytes([blob[100] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert bc.run(bc.get(key)) is None  # the client's sha256 check catches it
    assert bc.stats.corrupt_reads == 1
    # a file rewritten behind the gateway's back (a new mtime): the gateway itself finds it and drops it
    key2, blob2 = key_for(5), random_bytes(64 * 1024, seed=5)
    bc.run(bc.put(key2, blob2))
    path2 = gateway.data_dir / "blocks" / key2
    raw = bytearray(path2.read_bytes())
    raw[100] ^= 0xFF
    path2.write_bytes(bytes(raw))
    assert bc.run(bc.get(key2)) is None
    assert httpx.head(f"{gateway.url}/v1/blocks/{key2}").status_code == 404
    assert not path2.exists()


def test_parts_through_client(bc: BlockClient) -> None:
    key, blob = key_for(4), random_bytes(4096, seed=4)
    bc.run(bc.put(key, blob[2048:], content_range=(2048, 4096, 4096)))
    assert bc.run(bc.get(key)) is None
    bc.run(bc.put(key, blob[:2048], content_range=(0, 2048, 4096)))
    assert bc.run(bc.get(key)) == blob


def test_inflight_budget_drops_and_counts() -> None:
    with BlockClient(ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", max_inflight_bytes=1000)) as c:
        assert c.reserve(600)
        assert not c.reserve(600)
        assert c.stats.dropped_stores == 1
        c.release(600)
        assert c.reserve(1000)
        c.release(1000)
        assert c.inflight_bytes == 0


def test_gateway_down_is_an_outage_and_fails_fast() -> None:
    cfg = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", retries=3, down_cooldown_s=30.0)
    with BlockClient(cfg) as c:
        with pytest.raises(GatewayUnavailable):
            c.run(c.get(key_for(5)), timeout_s=10)
        assert c.gateway_down
        retries = c.stats.retries
        for _ in range(50):  # later calls fail at once, without another attempt on the network
            with pytest.raises(GatewayUnavailable, match="marked down"):
                c.run(c.put(key_for(5), b"x"), timeout_s=10)
        assert c.stats.retries == retries


def test_retries_ride_over_a_restart(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    cfg = ClientConfig(base_url=gw.url, retries=8, backoff_s=0.1, down_cooldown_s=0.0)
    try:
        with BlockClient(cfg) as c:
            c.run(c.put(key_for(6), b"before"))
            gw.kill9()
            restarter = threading.Thread(target=gw.start)
            restarter.start()
            try:
                got = c.run(c.get(key_for(6)), timeout_s=60)  # the retries span the restart
            finally:
                restarter.join()
            assert got == b"before"
            assert c.stats.retries >= 1
    finally:
        gw.stop()


def test_submit_from_many_threads(bc: BlockClient) -> None:
    blobs = {key_for(100 + i): random_bytes(32 * 1024, seed=100 + i) for i in range(16)}
    futs = []

    def worker(items: list[tuple[str, bytes]]) -> None:
        futs.extend(bc.submit(bc.put(k, v)) for k, v in items)

    items = list(blobs.items())
    threads = [threading.Thread(target=worker, args=(items[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(f.result(timeout=30) for f in futs)
    for k, v in blobs.items():
        assert bc.run(bc.get(k)) == v
