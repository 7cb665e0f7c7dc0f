"""Every byte a connector loads is verified: Range loads of any size (a cross-TP load is always a Range GET), and a
200 answer to a Range request (an intermediary that dropped the Range), against a real gateway process."""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from connector.http.client import BlockClient, ClientConfig
from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway

MiB = 1024 * 1024


def rot(path: Path, at: int) -> None:
    """Bit rot: one byte changes in place, inode and mtime stay (the gateway's version stamp cannot see it)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        old = f.read(1)
        f.seek(at)
        f.write(bytes([old[0] ^ 0x5A]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.fixture
def unbounded(tmp_path: Path) -> Iterator[Gateway]:
    """A gateway told what made earlier releases skip checking ranges (KVGATE_VERIFY_RANGE_MAX_BYTES=0: never);
    this release has no such setting and checks every range."""
    gw = Gateway(tmp_path / "data", env={"KVGATE_VERIFY_RANGE_MAX_BYTES": "0"}).start()
    try:
        yield gw
    finally:
        gw.stop()


def test_range_loads_of_a_corrupt_object_are_refused_at_any_size(unbounded: Gateway) -> None:
    """On main (the range digest only up to verify_range_max_bytes) the client took the rotten range as it came."""
    with BlockClient(ClientConfig(base_url=unbounded.url, max_connections=4)) as bc:
        key, blob = key_for(1), random_bytes(2 * MiB, seed=1)
        assert bc.run(bc.put(key, blob))
        rot(unbounded.data_dir / "blocks" / key, 1 * MiB + 12345)
        # a TP=2 reader's halves: rank 0's bytes are intact and verified; rank 1's hold the rotten byte
        assert bc.run(bc.get(key, byte_range=(0, 1 * MiB))) == blob[: 1 * MiB]
        assert bc.run(bc.get(key, byte_range=(1 * MiB, 2 * MiB))) is None
        assert bc.stats.corrupt_reads == 1  # the client's check: the gateway vouched from the chunk checksums
        # a range that cuts the rotten chunk: the gateway reads that chunk, finds it rotten, and answers a miss
        assert bc.run(bc.get(key, byte_range=(1 * MiB + 12000, 1 * MiB + 13000))) is None
        assert (
            httpx.get(f"{unbounded.url}/v1/blocks/{key}", headers={"Range": "bytes=1060000-1060100"}).status_code == 404
        )
        assert bc.run(bc.get(key)) is None  # and the whole object too
        assert bc.stats.gets == 1


def test_a_range_load_above_64_mib_of_a_corrupt_object_is_refused(gateway: Gateway) -> None:
    """On main a Range GET of an object above 64 MiB carried no range digest at all."""
    size = 65 * MiB + 3
    with BlockClient(ClientConfig(base_url=gateway.url, max_connections=2, request_timeout_s=120)) as bc:
        key, blob = key_for(2), os.urandom(size)
        assert bc.run(bc.put(key, blob), timeout_s=120)
        rot(gateway.data_dir / "blocks" / key, size - 5 * MiB)
        half = size // 2
        assert bc.run(bc.get(key, byte_range=(0, half)), timeout_s=120) == blob[:half]
        assert bc.run(bc.get(key, byte_range=(half, size)), timeout_s=120) is None
        assert bc.stats.corrupt_reads == 1


class _DropRange(http.server.BaseHTTPRequestHandler):
    """A proxy that forwards GETs without their Range header (some caches and proxies do): a 200 with the whole
    object and the gateway's headers comes back to a Range request."""

    upstream = ""

    def do_GET(self) -> None:
        got = httpx.get(f"{self.upstream}{self.path}")
        self.send_response(got.status_code)
        for name in ("Content-Type", "ETag", "X-KVGate-Checksum", "X-KVGate-SHA256"):
            if name in got.headers:
                self.send_header(name, got.headers[name])
        self.send_header("Content-Length", str(len(got.content)))
        self.end_headers()
        self.wfile.write(got.content)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def drop_range(gateway: Gateway) -> Iterator[str]:
    handler = type("Handler", (_DropRange,), {"upstream": gateway.url})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.parametrize("checksum", ["crc64nvme", "sha256"])
def test_a_200_answer_to_a_range_request_is_checked_whole_then_sliced(
    gateway: Gateway, drop_range: str, checksum: str
) -> None:
    """On main such an answer was checked against the whole object's ETag after slicing when the range started at 0
    (a false 'corrupt': a miss), and not checked at all otherwise (rotten bytes loaded)."""
    with BlockClient(ClientConfig(base_url=gateway.url, checksum=checksum)) as writer:
        key, blob = key_for(3), random_bytes(256 * 1024, seed=3)
        assert writer.run(writer.put(key, blob))
    with BlockClient(ClientConfig(base_url=drop_range, checksum=checksum)) as bc:
        assert bc.run(bc.get(key, byte_range=(0, 1000))) == blob[:1000]
        assert bc.run(bc.get(key, byte_range=(5000, 9000))) == blob[5000:9000]
        assert bc.run(bc.get(key)) == blob
        assert bc.stats.corrupt_reads == 0
        rot(gateway.data_dir / "blocks" / key, 200_000)
        assert bc.run(bc.get(key, byte_range=(5000, 9000))) is None  # the whole is checked, the slice never served
        assert bc.run(bc.get(key, byte_range=(0, 1000))) is None
        assert bc.stats.corrupt_reads == 2
