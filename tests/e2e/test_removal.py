"""Removal and repair across crashes, against real processes (issue 41, findings 3, 4 and 7).

- a key whose row names a version a crash left staged (the row swapped, the rename not done) is removed by DELETE,
  eviction or purge: the old file under the key goes too, so a restart cannot bring an older version back;
- a block whose bytes are corrupt is quarantined before its row goes: a crash right after the row went leaves a
  miss after the restart, never the corrupt bytes served under a fresh checksum;
- a staged file is never on disk unlocked: a sweep that runs while a writer creates it leaves it alone.

The crash points are held by test-only hooks (tests/e2e/faults/sitecustomize.py) and by a writer killed between
its commit and its rename (tests/e2e/crash_writer.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.capacity.helpers import block_files, index_rows
from tests.conftest import TEST_NS, key_for, random_bytes
from tests.gateway import REPO, Gateway

BLOCK = 64 * 1024
FAULTS = Path(__file__).parent / "faults"


def _wait_for(flag: Path, proc: subprocess.Popen[bytes] | Gateway, *, timeout_s: float = 60.0) -> None:
    p = proc.proc if isinstance(proc, Gateway) else proc
    deadline = time.monotonic() + timeout_s
    while not flag.exists():
        if p is not None and p.poll() is not None:
            raise AssertionError(f"{p.args} exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{flag.name} not reached in {timeout_s}s")
        time.sleep(0.02)


def _spawn(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _fault(point: str, flags: Path) -> dict[str, str]:
    return {"PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}", "KVGATE_TEST_FAULT": f"{point}:{flags}"}


def _crash_after_commit(gw: Gateway, key: str, flags: Path) -> None:
    """A writer in another process commits the row naming a new version of ``key`` and dies before its rename:
    the row names the staged version, the key's file is still the old one."""
    writer = _spawn(
        [
            "tests.e2e.crash_writer",
            *("--root", str(gw.data_dir / "blocks"), "--db", str(gw.data_dir / "index.db")),
            *("--key", key, "--seed", "2", "--flags", str(flags)),
        ]
    )
    try:
        _wait_for(flags / "staged", writer)
        (flags / "commit").touch()
        _wait_for(flags / "committed", writer)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
    assert [p for p in (gw.data_dir / "blocks").rglob(".kvgate-tmp-*")], "the crash left no staged version"


# -- finding 3: an acknowledged removal is not undone -----------------------------------------------------------


@pytest.mark.parametrize("how", ["delete", "evict", "purge"])
def test_removal_of_a_key_a_crash_left_staged_survives_the_restart(tmp_path: Path, how: str) -> None:
    """DELETE, eviction and purge of a key whose row names a version a crash left staged: after a restart (whose
    reconcile adopts any block file without a row) the key is a miss. Before, the removal unlinked the key's file
    only if it was the row's version; it was the older one, so it stayed, and the restart served it again."""
    env = {"KVGATE_MAX_BYTES": str(3 * BLOCK), "KVGATE_EVICTION_INTERVAL_S": "0.1"} if how == "evict" else {}
    gw = Gateway(tmp_path / "data", env=env).start()
    key, flags = key_for(1), tmp_path / "flags"
    flags.mkdir()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{key}", content=random_bytes(BLOCK, 1)).status_code == 201
            _crash_after_commit(gw, key, flags)
            if how == "delete":
                assert c.delete(f"/v1/blocks/{key}").status_code == 204
            elif how == "purge":
                assert c.delete(f"/v1/namespaces/{TEST_NS}").status_code == 200
            else:
                for i in range(2, 6):  # room is needed: the crashed key is the least recently used
                    assert c.put(f"/v1/blocks/{key_for(i)}", content=random_bytes(BLOCK, i)).status_code == 201
                deadline = time.monotonic() + 60
                while c.head(f"/v1/blocks/{key}").status_code != 404 and time.monotonic() < deadline:
                    time.sleep(0.1)  # bounded wait for the background eviction round
            assert c.head(f"/v1/blocks/{key}").status_code == 404
        gw.stop()
        gw.start()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.get(f"/v1/blocks/{key}").status_code == 404, "an acknowledged removal was undone"
            assert c.head(f"/v1/blocks/{key}").status_code == 404
        assert key not in index_rows(gw.data_dir) and key not in block_files(gw.data_dir)
        assert not [p for p in (gw.data_dir / "blocks").rglob(".kvgate-tmp-*")]
    finally:
        gw.stop()


def _served_by_a_ready_worker(url: str, *, tries: int = 50) -> httpx.Client:
    """A client whose one keep-alive connection a serving worker accepted: the kernel spreads connections over the
    workers' sockets, and one that lands on a worker still starting waits there."""
    for _ in range(tries):
        c = httpx.Client(base_url=url, timeout=30, limits=httpx.Limits(max_connections=1))
        try:
            if c.get("/readyz", timeout=1.0).status_code == 200:
                return c
        except httpx.TimeoutException:
            pass
        c.close()
    raise AssertionError("no worker accepted a connection")


def test_a_worker_serving_before_start_up_reconcile_removes_what_the_key_holds(tmp_path: Path) -> None:
    """``serve --workers 2`` on a data dir a crash left between a PUT's row swap and its rename; worker 0's start-up
    reconcile is held while worker 1 serves a DELETE of that key (204). After worker 0's reconcile and a restart
    the key is a miss. Before, worker 1 unlinked nothing (the file was not the row's version) and the reconcile
    adopted the older file: the acknowledged DELETE was undone."""
    data_dir, key, flags = tmp_path / "data", key_for(11), tmp_path / "flags"
    flags.mkdir()
    gw = Gateway(data_dir).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{key}", content=random_bytes(BLOCK, 11)).status_code == 201
        _crash_after_commit(gw, key, flags)
        gw.stop()
        held = flags / "reconcile"
        held.mkdir()
        gw = Gateway(data_dir, port=gw.port, workers=2, env=_fault("reconcile", held))
        env = {**os.environ, "KVGATE_LOG_LEVEL": "warning", "KVGATE_DATA_DIR": str(data_dir), **gw.extra_env}
        argv = [sys.executable, "-m", "app", "serve", "--port", str(gw.port), "--workers", "2"]
        gw._spawn(argv, env=env, ready=(held / "held").exists, timeout_s=90)  # worker 0 is held in its reconcile
        c = _served_by_a_ready_worker(gw.url)  # worker 1: worker 0 accepts nothing before its reconcile is done
        try:
            assert c.delete(f"/v1/blocks/{key}").status_code == 204
        finally:
            c.close()
        (held / "go").touch()
        deadline = time.monotonic() + 60
        while not gw.all_workers_ready():  # worker 0 listens once its reconcile is done
            assert time.monotonic() < deadline, "worker 0 did not finish its reconcile"
            time.sleep(0.1)
        gw.stop()
        gw = Gateway(data_dir, port=gw.port).start()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.get(f"/v1/blocks/{key}").status_code == 404, "an acknowledged removal was undone"
        assert key not in index_rows(data_dir) and key not in block_files(data_dir)
    finally:
        gw.stop()


# -- finding 4: corrupt bytes are quarantined before their row goes ---------------------------------------------


def test_a_crash_after_a_corrupt_blocks_row_went_leaves_a_miss(tmp_path: Path) -> None:
    """A bit flipped in a stored file; ``kvgate gc`` finds the block corrupt and is killed right after its row
    went. After the restart the key is a miss. Before, the row went first and the file after: the restart adopted
    the corrupt file, recorded a fresh checksum of the corrupt bytes and served them with 200."""
    data_dir = tmp_path / "data"
    gw = Gateway(data_dir).start()
    key, body, flags = key_for(7), random_bytes(BLOCK, 7), tmp_path / "flags"
    flags.mkdir()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{key}", content=body).status_code == 201
        gw.stop()
        path = data_dir / "blocks" / key
        with path.open("r+b") as f:  # bit rot: one bit of the stored bytes flipped in place
            f.seek(BLOCK // 2)
            byte = f.read(1)[0]
            f.seek(BLOCK // 2)
            f.write(bytes([byte ^ 0x10]))
        (flags / "arm").touch()
        gc = _spawn(["app", "gc"], env={"KVGATE_DATA_DIR": str(data_dir), **_fault("removed", flags)})
        try:
            _wait_for(flags / "held", gc)
        finally:
            gc.send_signal(signal.SIGKILL)
            gc.wait(10)
        assert key not in index_rows(data_dir)
        gw.start()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            got = c.get(f"/v1/blocks/{key}")
            assert got.status_code == 404, f"corrupt bytes served after a crash: {got.status_code}"
            assert c.head(f"/v1/blocks/{key}").status_code == 404
            assert not c.post("/v1/lookup", json={"keys": [key]}).json()["blocks"][0]["present"]
        assert key not in index_rows(data_dir) and key not in block_files(data_dir)
    finally:
        gw.stop()


# -- finding 7: a staged file is created locked -----------------------------------------------------------------


def test_a_sweep_while_a_writer_creates_its_staged_file_leaves_it_alone(tmp_path: Path) -> None:
    """A PUT is held between the creation of its staged file and its writer's lock while ``kvgate gc`` sweeps
    staged files nobody holds. Before, the file was on disk unlocked in that gap: gc deleted it, the row committed
    naming it, and the PUT answered 500 (an untranslated FileNotFoundError from the rename); the key then named a
    version that was gone."""
    data_dir, flags = tmp_path / "data", tmp_path / "flags"
    flags.mkdir()
    gw = Gateway(data_dir, env=_fault("stage-lock", flags)).start()
    key, body = key_for(3), random_bytes(BLOCK, 3)
    try:
        with httpx.Client(base_url=gw.url, timeout=60) as c:
            assert c.put(f"/v1/blocks/{key_for(4)}", content=random_bytes(BLOCK, 4)).status_code == 201  # the dir
            (flags / "arm").touch()
            answer: dict[str, httpx.Response] = {}
            put = threading.Thread(target=lambda: answer.update(r=c.put(f"/v1/blocks/{key}", content=body)))
            put.start()
            _wait_for(flags / "held", gw)
            gc = _spawn(["app", "gc"], env={"KVGATE_DATA_DIR": str(data_dir)})
            assert gc.wait(120) == 0
            (flags / "go").touch()
            put.join(60)
            assert answer["r"].status_code == 201, answer["r"].text
            got = c.get(f"/v1/blocks/{key}")
            assert (got.status_code, got.content) == (200, body)
        assert index_rows(data_dir) == block_files(data_dir)
    finally:
        gw.stop()
