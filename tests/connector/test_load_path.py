"""The load path: ``BlockClient.get_into`` reads a block straight into the caller's buffer and verifies it there, and
the loader (connector/worker/loader.py) gives every load buffer back, whatever ends a load.

A real gateway serves the bytes; a stdlib HTTP server that ignores Range stands for a server kvgate did not write
(it answers 200 with the whole object and its ETag).
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.http.client import BlockClient, ClientConfig
from tests.conftest import key_for, random_bytes
from tests.connector.test_pipeline import full_kv, hashes, job, pipeline, run_naming, same, shard
from tests.gateway import Gateway


@pytest.fixture
def bc(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url, max_connections=8)) as c:
        yield c


def test_get_into_writes_the_verified_bytes_in_place(bc: BlockClient) -> None:
    key, blob = key_for(40), random_bytes(2 * 1024 * 1024 + 3, seed=40)
    assert bc.run(bc.put(key, blob))
    into = bytearray(len(blob) + 10)
    assert bc.run(bc.get_into(key, memoryview(into)[5 : 5 + len(blob)]))
    assert bytes(into[5 : 5 + len(blob)]) == blob and into[:5] == bytes(5) and into[-5:] == bytes(5)
    part = bytearray(4000)
    assert bc.run(bc.get_into(key, memoryview(part), byte_range=(1000, 5000)))
    assert bytes(part) == blob[1000:5000]
    assert bc.stats.gets == 2 and bc.stats.get_bytes == len(blob) + 4000


def test_get_into_refuses_a_miss_a_wrong_size_and_a_corrupt_body(bc: BlockClient, gateway: Gateway) -> None:
    assert not bc.run(bc.get_into(key_for(41), memoryview(bytearray(8))))
    assert bc.stats.misses == 1 and bc.stats.corrupt_reads == 0
    key, blob = key_for(42), random_bytes(300 * 1024, seed=42)
    assert bc.run(bc.put(key, blob))
    assert not bc.run(bc.get_into(key, memoryview(bytearray(len(blob) - 1))))  # longer than the buffer
    assert not bc.run(bc.get_into(key, memoryview(bytearray(len(blob) + 1))))  # shorter
    assert bc.stats.corrupt_reads == 2
    path = gateway.data_dir / "blocks" / key
    st = path.stat()
    with path.open("r+b") as f:  # bit rot behind the gateway's back: inode and mtime stay
        f.seek(7)
        f.write(bytes([blob[7] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not bc.run(bc.get_into(key, memoryview(bytearray(len(blob)))))
    assert bc.stats.corrupt_reads == 3 and bc.stats.gets == 0


class _IgnoresRange(http.server.BaseHTTPRequestHandler):
    body = b""
    etag = ""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("ETag", f'"{self.etag}"')
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def ignores_range() -> Iterator[tuple[str, bytes, type[_IgnoresRange]]]:
    blob = random_bytes(100_000, seed=43)
    handler = type("Handler", (_IgnoresRange,), {"body": blob, "etag": hashlib.sha256(blob).hexdigest()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", blob, handler
    server.shutdown()
    server.server_close()


def test_a_whole_answer_to_a_range_is_verified_then_sliced(
    ignores_range: tuple[str, bytes, type[_IgnoresRange]],
) -> None:
    url, blob, handler = ignores_range
    with BlockClient(ClientConfig(base_url=url)) as c:
        assert c.run(c.get(key_for(44), byte_range=(0, 5000))) == blob[:5000]  # was refused: slice vs whole ETag
        assert c.run(c.get(key_for(44), byte_range=(200, 900))) == blob[200:900]
        handler.etag = "0" * 64  # the whole object no longer matches its ETag: no slice of it is used
        assert c.run(c.get(key_for(44), byte_range=(200, 900))) is None  # was used unverified
        assert c.stats.corrupt_reads == 1


def test_get_into_verifies_a_whole_answer_to_a_range_then_slices(
    ignores_range: tuple[str, bytes, type[_IgnoresRange]],
) -> None:
    url, blob, handler = ignores_range
    with BlockClient(ClientConfig(base_url=url)) as c:
        part = bytearray(5000)
        assert c.run(c.get_into(key_for(44), memoryview(part), byte_range=(200, 5200)))
        assert bytes(part) == blob[200:5200]
        handler.etag = "0" * 64
        assert not c.run(c.get_into(key_for(44), memoryview(part), byte_range=(0, 5000)))
        assert c.stats.corrupt_reads == 1


def test_every_load_buffer_comes_back_whatever_ends_a_load(bc: BlockClient, tmp_path: Path) -> None:
    dtype = torch.bfloat16
    nm = run_naming(tp=1, rank=0, dtype=dtype)
    src = shard(full_kv(dtype=dtype, seed=44), tp=1, rank=0)
    writer = pipeline(bc, src, nm, tp=1, rank=0)
    hs = hashes(440, 11)
    writer.store(job("w", hs[:10], list(range(10))))  # the 11th block is never stored
    writer.wait_uploads(60)
    dest = shard(full_kv(dtype=dtype, seed=45), tp=1, rank=0)
    reader = pipeline(bc, dest, nm, tp=1, rank=0)  # windows of 4 blocks, 4 load buffers
    pool = reader.transfers[0].load_pool
    # whole: 3 windows, the next one read while one is scattered
    assert reader.load(job("a", hs[:10], list(range(20, 30)))).result(timeout=60) == set()
    for name in src:
        assert same(dest[name][:, 20:30], src[name][:, 0:10])
    # a miss in the third window: 8 blocks load, the rest is reported
    failed = reader.load(job("b", hs[2:11], list(range(30, 39)))).result(timeout=60)
    assert failed == {38}
    # a block id the KV cache does not have: the scatter refuses it; blocks before its window loaded
    failed = reader.load(job("c", hs[:10], [*range(0, 9), 10_000])).result(timeout=60)
    assert failed == {8, 10_000}
    # several loads at once over the 4 buffers (2 windows each in flight at most)
    futs = [reader.load(job(f"d{i}", hs[:10], list(range(i * 10, i * 10 + 10)))) for i in range(4)]
    assert [f.result(timeout=60) for f in futs] == [set()] * 4
    assert pool.available == pool.size
    assert reader.stats.loaded_blocks == 10 + 8 + 8 + 40
