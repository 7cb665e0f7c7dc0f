"""The coordination file has an identity: a gateway whose ``kvgate.coord`` is removed (and recreated by another
process of the same data directory) shares no locks and no cache epochs with the others any more, and must not act
as if it did. Real processes: two gateways on one data directory, the file removed between their starts.

Before, the first gateway's metadata cache kept the row of a key the second had deleted (no epoch it could see
moved): HEAD answered 200 for the deleted key, and a re-PUT of the same bytes 200 without storing anything (GET 404
after)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import key_for, matches, random_bytes
from tests.gateway import REPO, Gateway


def _call(method: Callable[..., httpx.Response], url: str, **kwargs: Any) -> int:
    """The status, or 0 once the gateway has closed its socket (it found its file gone and is on its way out)."""
    try:
        return method(url, timeout=30, **kwargs).status_code
    except httpx.TransportError:
        return 0


@pytest.mark.parametrize("order", ["head-first", "put-first"])
def test_a_replaced_coordination_file_fails_closed(tmp_path: Path, order: str) -> None:
    data = tmp_path / "data"
    first = Gateway(data).start()
    second = Gateway(data, port=None)
    key, blob = key_for(7300), random_bytes(4096, 7300)
    try:
        assert httpx.put(f"{first.url}/v1/blocks/{key}", content=blob, timeout=30).status_code == 201
        assert httpx.head(f"{first.url}/v1/blocks/{key}", timeout=30).status_code == 200  # cached in the first
        (data / "kvgate.coord").unlink()
        second.start()  # creates the file anew
        assert httpx.delete(f"{second.url}/v1/blocks/{key}", timeout=30).status_code == 204
        stored = False
        for step in ("head", "put") if order == "head-first" else ("put", "head"):
            if step == "head":
                head = _call(httpx.head, f"{first.url}/v1/blocks/{key}")
                assert head in ((0, 200) if stored else (0, 404)), f"HEAD {head}: from a cache no epoch reaches"
            else:
                status = _call(httpx.put, f"{first.url}/v1/blocks/{key}", content=blob)
                stored = status == 201
                assert status in (0, 201, 503), status  # refused, or stored: never a 200 that stores nothing
                if status == 201:
                    got = httpx.get(f"{second.url}/v1/blocks/{key}", timeout=30)
                    assert got.status_code == 200 and got.content == blob
        # the first gateway stops by itself (a supervisor or service manager starts another)
        deadline = time.monotonic() + 30
        while first.proc is not None and first.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert first.proc is not None and first.proc.poll() is not None, "still serving with a lost coordination file"
        first.start()  # the one started again shares the new file
        assert httpx.put(f"{first.url}/v1/blocks/{key}", content=blob, timeout=30).status_code in (200, 201)
        assert httpx.head(f"{first.url}/v1/blocks/{key}", timeout=30).status_code == 200
        assert httpx.delete(f"{second.url}/v1/blocks/{key}", timeout=30).status_code == 204
        assert httpx.head(f"{first.url}/v1/blocks/{key}", timeout=30).status_code == 404
        got = httpx.get(f"{first.url}/v1/blocks/{key}", timeout=30)
        assert got.status_code == 404
        assert httpx.put(f"{first.url}/v1/blocks/{key}", content=blob, timeout=30).status_code == 201
        got = httpx.get(f"{second.url}/v1/blocks/{key}", timeout=30)
        assert got.status_code == 200 and got.content == blob and matches(got.headers["etag"], blob)
    finally:
        first.stop()
        second.stop()


def test_another_data_dir_on_the_same_blocks_and_index_is_refused(tmp_path: Path) -> None:
    """``kvgate gc`` (or ``serve``) through another --data-dir on a running gateway's blocks and index would share
    no key locks and no cache epochs with it: refused while that gateway's coordination file is alive."""
    data = tmp_path / "data"
    gw = Gateway(data).start()
    shared = {
        "KVGATE_BACKEND__ROOT": str(data / "blocks"),
        "KVGATE_DB_URL": f"sqlite+aiosqlite:///{data / 'index.db'}",
    }
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), **shared}
        gc = subprocess.run(
            [sys.executable, "-m", "app", "gc", "--json", "--data-dir", str(tmp_path / "other")],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert gc.returncode != 0, gc.stdout.decode()
        assert "another data directory" in gc.stderr.decode()
        with pytest.raises(RuntimeError, match="another data directory"):
            Gateway(tmp_path / "other", env=shared).start()
        ok = subprocess.run(  # its own data directory: fine, beside the gateway
            [sys.executable, "-m", "app", "gc", "--json", "--data-dir", str(data)],
            cwd=REPO,
            env=env,
            capture_output=True,
            timeout=120,
        )
        assert ok.returncode == 0, ok.stderr.decode()[-2000:]
    finally:
        gw.stop()


def _open_inodes(pid: int) -> set[int]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            found.add(os.stat(fd).st_ino)
        except OSError:
            continue
    return found


def test_a_removed_coordination_file_under_workers_is_refused_then_every_worker_restarts(tmp_path: Path) -> None:
    """``--workers 2``, the file removed and nobody makes it again: a worker that had not locked anything yet opened
    its next lock by the file's name (ENOENT: a 500, and it went on serving without noticing). Every change is
    refused (503) until each worker has stopped by itself; those the supervisor starts share the new file."""
    data = tmp_path / "data"
    gw = Gateway(data, workers=2).start()
    blob = random_bytes(4096, 7400)
    try:
        old = set(gw.worker_pids())
        assert len(old) == 2
        (data / "kvgate.coord").unlink()
        statuses: set[int] = set()
        deadline = time.monotonic() + 30
        i = 0
        while old & set(gw.worker_pids()) and time.monotonic() < deadline:
            statuses.add(_call(httpx.put, f"{gw.url}/v1/blocks/{key_for(7400 + i)}", content=blob))
            i += 1
        assert not old & set(gw.worker_pids()), "a worker went on with its coordination file removed"
        assert statuses <= {0, 201, 503}, statuses  # refused or stored (before it noticed): never a 500
        deadline = time.monotonic() + 60
        while not gw.all_workers_ready() and time.monotonic() < deadline:
            time.sleep(0.1)
        coord = os.stat(data / "kvgate.coord").st_ino
        assert all(coord in _open_inodes(pid) for pid in gw.worker_pids())  # both on the file that is there now
        key = key_for(7399)
        assert httpx.put(f"{gw.url}/v1/blocks/{key}", content=blob, timeout=30).status_code == 201
        got = httpx.get(f"{gw.url}/v1/blocks/{key}", timeout=30)
        assert got.status_code == 200 and got.content == blob
    finally:
        gw.stop()


def test_idle_workers_notice_a_removed_coordination_file_by_themselves(tmp_path: Path) -> None:
    """No request at all after the removal: each worker checks its file on its own (every second) and restarts,
    rather than waiting for its next request (after a keep-alive pinned the traffic to the other worker, that may
    never come)."""
    data = tmp_path / "data"
    gw = Gateway(data, workers=2).start()
    try:
        old = set(gw.worker_pids())
        (data / "kvgate.coord").unlink()
        deadline = time.monotonic() + 30
        while old & set(gw.worker_pids()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not old & set(gw.worker_pids()), "an idle worker kept its removed coordination file"
    finally:
        gw.stop()
