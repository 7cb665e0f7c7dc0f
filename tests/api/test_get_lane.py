"""The GET lane (app/api/server/get_lane.py) answers byte for byte what the full ASGI stack answers.

Two real servers (``create_server``, uvicorn on loopback, in threads of this process) hold the same blocks, one with
the lane and one without (``get_lane=False``). The same raw HTTP/1.1 bytes go to both, over sockets: whole blocks
small and larger than a socket takes at once (``sendfile`` sends part, the transport the rest), ranges, misses, bad
keys, queries, pipelined and keep-alive requests, HTTP/1.0, ``Connection: close``, callers with and without the
right token. Every answer must be the same bytes (less the ``date`` line), the lane must have answered the ones it
can (and only those), and the request metrics and hit counters must come out equal. A file that is not its row's
version is never the lane's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from app.api.server.get_lane import MAX_BYTES, GetLane
from app.api.server.runner import GatewayServer
from tests.api.test_head_lane import (
    _exchange,
    _read_answers,
    _req,
    _request_samples,
    check_auth_as_the_stack,
    check_cases,
)
from tests.api.test_head_lane import _pair as pair_of_servers
from tests.conftest import key_for, random_bytes, sha
from tests.security.conftest import tokens_json

K1, K2, K3, K4, MISSING = key_for(1), key_for(2), key_for(3), key_for(4), key_for(9)
BODY1, BODY2 = random_bytes(5000, seed=1), random_bytes(70_000, seed=2)
BODY3 = random_bytes(3 * 1024 * 1024 + 17, seed=3)  # more than a fresh connection's socket takes at once
BODY4 = random_bytes(MAX_BYTES + 1, seed=4)  # over the lane's bound: the stack's


def _lane(server: GatewayServer) -> GetLane | None:
    lane: GetLane | None = getattr(server.server.config.http, "get_lane", None)
    return lane


def _get(key: str, *headers: str, version: str = "1.1") -> tuple[str, bytes]:
    return _req("GET", f"/v1/blocks/{key}", *headers, version=version)


@contextlib.contextmanager
def _pair(tmp_path: Path, **fields: Any) -> Iterator[tuple[tuple[str, GatewayServer], tuple[str, GatewayServer]]]:
    with pair_of_servers(tmp_path, lane="get_lane", **fields) as servers:
        yield servers


def _put_blocks(url: str, headers: dict[str, str] | None = None) -> None:
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        assert c.put(f"/v1/blocks/{K1}", content=BODY1).status_code == 201
        assert c.put(f"/v1/blocks/{K2}", content=BODY2, headers={"X-KVGate-SHA256": sha(BODY2)}).status_code == 201
        assert c.put(f"/v1/blocks/{K3}", content=BODY3).status_code == 201
        assert c.put(f"/v1/blocks/{K4}", content=BODY4).status_code == 201


def test_the_lane_answers_as_the_full_stack(tmp_path: Path) -> None:
    pct = K1.replace("_g0/", "%5Fg0/")  # uvicorn decodes the path: the same key
    cases: list[tuple[str, list[tuple[str, bytes]], int]] = [
        # (what, requests sent in one write, at least this many answered by the lane)
        ("cached block", [_get(K1)], 1),
        ("block stored with a sha256", [_get(K2)], 1),
        ("block larger than the socket takes at once", [_get(K3)], 1),
        ("block over the lane's bound", [_get(K4)], 0),
        ("miss", [_get(MISSING)], 0),
        ("bad key", [_get("not-a-key")], 0),
        ("percent-encoded path", [_get(pct)], 1),
        ("range", [_get(K1, "Range: bytes=10-99")], 0),
        ("range of the larger block", [_get(K3, "Range: bytes=1-2000000")], 0),
        ("query string", [_req("GET", f"/v1/blocks/{K1}?x=1")], 0),
        ("declared body", [_get(K1, "Content-Length: 0")], 0),
        ("HTTP/1.0", [_get(K1, version="1.0")], 1),
        ("Connection: close, then another request", [_get(K1, "Connection: close"), _get(K2)], 1),
        ("pipelined", [_get(K1), _get(K3), _req("HEAD", f"/v1/blocks/{K2}"), _get(MISSING), _get(K2)], 2),
        ("pipelined behind a range", [_get(K3, "Range: bytes=0-99"), _get(K1)], 0),
        ("keep-alive: several in turn", [_get(K1), _get(K3), _get(K2), _get(K3)], 4),
    ]
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, _)):
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        check_cases(lane, lane_url, stack_url, cases)
        # the bodies are the blocks' bytes
        whole = _exchange(lane_url, [_get(K3)])[0][0]
        assert whole.endswith(b"\r\n\r\n" + BODY3) and [whole] == _exchange(stack_url, [_get(K3)])[0]
        # changes are seen at once: an overwrite's new bytes, a deletion's 404
        for url in (lane_url, stack_url):
            with httpx.Client(base_url=url) as c:
                assert c.put(f"/v1/blocks/{K1}", content=BODY2).status_code in (200, 201)
                assert c.delete(f"/v1/blocks/{K2}").status_code == 204
        overwritten, deleted = _exchange(lane_url, [_get(K1)]), _exchange(lane_url, [_get(K2)])
        assert overwritten == _exchange(stack_url, [_get(K1)])
        assert deleted == _exchange(stack_url, [_get(K2)])
        assert overwritten[0][0].endswith(b"\r\n\r\n" + BODY2) and deleted[0][0].startswith(b"HTTP/1.1 404 ")
        assert _request_samples(lane_url) == _request_samples(stack_url)
        assert lane.served >= 14


def test_a_file_that_is_not_its_rows_version_is_not_the_lanes(tmp_path: Path) -> None:
    """Bytes put in place of a block's file behind the gateway's back (no version stamp of its own) are never
    sent by the lane: the stack's reader, with its checks and repair, answers instead, and not with those bytes."""
    with _pair(tmp_path) as ((lane_url, lane_server), _):
        _put_blocks(lane_url)
        lane = _lane(lane_server)
        assert lane is not None
        assert _exchange(lane_url, [_get(K1)])[0][0].endswith(BODY1)  # cached, and the lane's
        served = lane.served
        path = tmp_path / "lane" / "data" / "blocks" / K1
        if not path.exists():
            path = next(p for p in (tmp_path / "lane").rglob(K1.rsplit("/", 1)[1]) if p.is_file())
        foreign = random_bytes(len(BODY1), seed=99)
        swap = path.with_name(path.name + ".foreign")
        swap.write_bytes(foreign)
        os.replace(swap, path)
        answer = _exchange(lane_url, [_get(K1)])[0][0]
        assert lane.served == served
        assert not answer.endswith(foreign)


def _resident_pages(path: Path) -> int:
    """How many of the file's pages the page cache holds (mincore of a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def _evicted(path: Path) -> bool:
    """Write the file's pages back and drop them from the page cache (a page still in use, e.g. by a socket that
    has not yet had its acknowledgement, stays: try again a few times)."""
    for _ in range(40):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        if _resident_pages(path) == 0:
            return True
        time.sleep(0.05)
    return False


def test_a_file_out_of_the_page_cache_is_not_the_lanes(tmp_path: Path) -> None:
    """sendfile of a file the page cache does not hold would wait on the disk in the event loop: the larger block's
    pages dropped right after its PUT (written back, then POSIX_FADV_DONTNEED), its GET goes to the stack (whose
    reader reads in a worker thread) with the same answer as a server without the lane; once read, it is cached
    again and the lane's."""
    with _pair(tmp_path) as ((lane_url, lane_server), (stack_url, _)):
        _put_blocks(lane_url)
        _put_blocks(stack_url)
        lane = _lane(lane_server)
        assert lane is not None
        want = _exchange(stack_url, [_get(K3)])[0]
        path = next(p for p in (tmp_path / "lane").rglob(K3.rsplit("/", 1)[1]) if p.is_file())
        assert _evicted(path), "the kernel kept the file's pages"
        served = lane.served
        assert _exchange(lane_url, [_get(K3)])[0] == want
        assert lane.served == served
        assert _exchange(lane_url, [_get(K3)])[0] == want
        assert lane.served == served + 1


def test_the_lane_applies_auth_as_the_stack(tmp_path: Path) -> None:
    with _pair(tmp_path, tokens=json.loads(tokens_json())) as servers:
        check_auth_as_the_stack(servers, put_blocks=_put_blocks, lane_of=_lane, request=lambda *h: _get(K1, *h))


def test_a_client_that_does_not_read_is_not_sent_more(tmp_path: Path) -> None:
    """Twelve GETs of the 3 MiB block pipelined by a client that reads nothing for a while: the lane answers only
    while the transport's writes are not paused (the socket's buffers, then one answer's rest held by the
    transport); the others wait in the stack's pipeline, each for the client to read, as they always did. Without
    that bound the lane wrote all twelve at once (36 MiB held for a client that reads nothing). Then every answer
    arrives, in order, byte for byte."""
    with _pair(tmp_path) as ((lane_url, lane_server), _):
        _put_blocks(lane_url)
        lane = _lane(lane_server)
        assert lane is not None
        parts = urlsplit(lane_url)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            sock.settimeout(10)
            sock.connect((parts.hostname, parts.port))
            before = lane.served
            sock.sendall(_get(K3)[1] * 12)
            time.sleep(1.0)  # the server's writes fill the sockets' buffers and then wait
            answered = lane.served - before
            answers = _read_answers(sock, ["GET"] * 12)
        assert 1 <= answered <= 4, answered
        assert len(answers) == 12 and all(a.endswith(b"\r\n\r\n" + BODY3) for a in answers)
