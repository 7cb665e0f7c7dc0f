"""Integrity across processes and crashes, each case deterministic, against real processes where one takes part.

- a writer killed between the index commit naming its version and the rename: recovery publishes that version
  (rolls forward), whether its staging finished before or after the version on disk was written;
- ``kvgate gc`` and ``kvgate import`` beside a live gateway, held at the worst moment (after their snapshot, before
  they act) while the gateway writes, overwrites and deletes: nothing the gateway acknowledged is undone;
- a version's stamp never names another version, even where the kernel hands the next file the same inode and the
  same mtime;
- a directory fsync that fails after the rename leaves the new version served (the row is not put back over it);
- an acknowledged DELETE has fsynced the directory (it survives a power loss);
- an abandoned multi-part upload is dropped by a running gateway, and its bytes are freed by eviction.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from app.config import FsBackend
from tests.capacity.helpers import block_files, index_rows
from tests.conftest import key_for, matches, random_bytes
from tests.gateway import REPO, Gateway

BLOCK = 64 * 1024


def _wait_for(flag: Path, proc: subprocess.Popen[bytes], *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not flag.exists():
        if proc.poll() is not None:
            out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
            raise AssertionError(f"{proc.args} exited with {proc.returncode}: {out}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{flag.name} not reached in {timeout_s}s")
        time.sleep(0.02)


def _spawn(args: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _agree(gw: Gateway, expected: dict[str, bytes | None]) -> None:
    """HEAD, GET and lookup answer ``expected`` (None: absent), each body under its own digest; rows == files."""
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        look = c.post("/v1/lookup", json={"keys": list(expected)}).json()["blocks"]
        for slot, (key, body) in zip(look, expected.items(), strict=True):
            head, got = c.head(f"/v1/blocks/{key}"), c.get(f"/v1/blocks/{key}")
            if body is None:
                assert (head.status_code, got.status_code, slot["present"]) == (404, 404, False), key
                continue
            assert (head.status_code, got.status_code, slot["present"]) == (200, 200, True), key
            assert got.content == body, key
            assert got.headers["etag"] == head.headers["etag"] == slot["etag"] and matches(slot["etag"], body), key
        stats = c.get("/v1/stats").json()
    assert index_rows(gw.data_dir) == block_files(gw.data_dir)
    present = [b for b in expected.values() if b is not None]
    assert (stats["blocks"], stats["usage_bytes"]) == (len(present), sum(len(b) for b in present))


# -- a crash between the commit and the rename ------------------------------------------------------------------


@pytest.mark.parametrize("order", ["staged-after", "staged-before"])
def test_recovery_publishes_the_committed_version_a_crash_left_staged(tmp_path: Path, order: str) -> None:
    """The row names version B, the key's file is still A, B sits staged: after the restart B is served. With B
    staged before A was written (two PUTs whose staging finished out of order), an earlier design called A
    "corrupt" by its mtime and removed A and the row: both versions lost."""
    gw = Gateway(tmp_path / "data")
    key, a, b = key_for(1), random_bytes(BLOCK, 1), random_bytes(BLOCK, 2)
    flags = tmp_path / "flags"
    flags.mkdir()
    writer_args = [
        "tests.e2e.crash_writer",
        *("--root", str(gw.data_dir / "blocks"), "--db", str(gw.data_dir / "index.db")),
        *("--key", key, "--seed", "2", "--flags", str(flags)),
    ]
    gw.start()
    writer: subprocess.Popen[bytes] | None = None
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            if order == "staged-before":
                assert c.put(f"/v1/blocks/{key}", content=random_bytes(BLOCK, 0)).status_code == 201
                writer = _spawn(writer_args)
                _wait_for(flags / "staged", writer)
                time.sleep(0.05)  # A is written a clear tick after B
            assert c.put(f"/v1/blocks/{key}", content=a).status_code in (200, 201)
        gw.stop()
        if writer is None:
            writer = _spawn(writer_args)
            _wait_for(flags / "staged", writer)
        (flags / "commit").touch()
        _wait_for(flags / "committed", writer)
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)
        gw.start()
        _agree(gw, {key: b})
    finally:
        if writer is not None and writer.poll() is None:
            writer.kill()
        gw.stop()


# -- gc and import beside a live gateway ------------------------------------------------------------------------


@pytest.fixture
def live(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path / "data").start()
    try:
        yield gw
    finally:
        gw.stop()


def test_gc_beside_a_live_gateway_never_undoes_its_writes(live: Gateway, tmp_path: Path) -> None:
    """gc reads the rows, lists the store, then acts. Held in both gaps while the gateway changes keys, it must
    act only on what is still so: an earlier design deleted the row of a key re-written after the listing missed
    it, and wrote a stale version over a key that was overwritten."""
    bodies = {i: random_bytes(BLOCK, 100 + i) for i in range(8)}
    k = {i: key_for(500 + i) for i in range(8)}
    flags = tmp_path / "flags"
    flags.mkdir()
    with httpx.Client(base_url=live.url, timeout=30) as c:
        for i in (0, 1, 2):
            assert c.put(f"/v1/blocks/{k[i]}", content=bodies[i]).status_code == 201
        gc = _spawn(["tests.e2e.held", "--flags", str(flags), "--at", "list", "--", "gc", "--json"], env=_env(live))
        try:
            _wait_for(flags / "before-list", gc)  # rows read, listing not begun
            assert c.delete(f"/v1/blocks/{k[0]}").status_code == 204  # in the rows, not in the listing
            assert c.put(f"/v1/blocks/{k[3]}", content=bodies[3]).status_code == 201  # in the listing, not the rows
            (flags / "list").touch()
            _wait_for(flags / "listed", gc)
            assert c.put(f"/v1/blocks/{k[0]}", content=bodies[4]).status_code == 201  # k0 written again
            assert c.put(f"/v1/blocks/{k[3]}", content=bodies[5]).status_code == 200  # k3 overwritten
            assert c.put(f"/v1/blocks/{k[1]}", content=bodies[6]).status_code == 200  # k1 overwritten
            assert c.delete(f"/v1/blocks/{k[2]}").status_code == 204  # k2 deleted
            (flags / "act").touch()
            out, _ = gc.communicate(timeout=120)
            assert gc.returncode == 0, out.decode()
        finally:
            if gc.poll() is None:
                gc.kill()
    _agree(live, {k[0]: bodies[4], k[1]: bodies[6], k[2]: None, k[3]: bodies[5]})


def test_import_in_place_beside_a_live_gateway_never_undoes_its_writes(live: Gateway, tmp_path: Path) -> None:
    """import adopts a file vLLM's fs tier wrote; held between hashing it and recording it, while the gateway
    stores another version of that key: the gateway's version stands (an earlier design recorded the file it had
    hashed over the gateway's row, and the next read removed both as corrupt)."""
    key, foreign, stored = key_for(600), random_bytes(BLOCK, 60), random_bytes(BLOCK, 61)
    path = live.data_dir / "blocks" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(foreign)
    flags = tmp_path / "flags"
    flags.mkdir()
    imp = _spawn(
        ["tests.e2e.held", "--flags", str(flags), "--at", "swap", "--", "import", str(live.data_dir / "blocks")],
        env=_env(live),
    )
    answer: list[int] = []
    put = threading.Thread(
        target=lambda: answer.append(httpx.put(f"{live.url}/v1/blocks/{key}", content=stored, timeout=60).status_code)
    )
    try:
        _wait_for(flags / "held", imp)
        put.start()
        put.join(2.0)  # where the import holds the key, the PUT waits for it; elsewhere it is done by now
        (flags / "act").touch()
        put.join(60)
        out, _ = imp.communicate(timeout=120)
        assert imp.returncode == 0, out.decode()
    finally:
        if imp.poll() is None:
            imp.kill()
    assert answer == [201] or answer == [200]
    _agree(live, {key: stored})


def _env(gw: Gateway) -> dict[str, str]:
    return {"KVGATE_DATA_DIR": str(gw.data_dir), "KVGATE_LOG_LEVEL": "warning"}


# -- the store: stamps, publish failures, durable removal ---------------------------------------------------------


async def _body(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def test_a_stamp_never_names_another_version(tmp_path: Path) -> None:
    """A reader holding version A's stamp opens the key after A was replaced by a file with A's inode and A's
    mtime (the kernel reuses inodes at once; before Linux 6.13 mtimes are tick-granular): it must be refused."""
    from app.errors import VersionMismatch
    from app.storage.filesystem import FilesystemStore

    store = FilesystemStore(root=tmp_path / "blocks", fsync=False)
    await store.start()
    key = key_for(700)
    for _ in range(200):
        first = await store.stage(key, _body(b"a" * 4096), size=4096)
        await store.publish(first)
        st = os.stat(store.path_of(key))
        await store.delete(key)
        other = await store.stage(key, _body(b"c" * 4096), size=4096)
        await store.publish(other)
        path = store.path_of(key)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        if os.stat(path).st_ino == st.st_ino:
            break
        await store.delete(key)
    else:
        pytest.skip("this filesystem did not reuse an inode in 200 tries")
    with pytest.raises(VersionMismatch):
        reader = await store.open(key, stamp=first.stamp)
        await reader.aclose()


async def test_a_failed_directory_fsync_after_the_rename_keeps_the_new_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename happened, then the directory fsync failed: the PUT answers 503 (its durability is unknown) but
    the key is served whole, as a version it had: an earlier design put the old row back over the new file, and
    the next read removed both."""
    from tests.inprocess.harness import running, settings_for

    key, a, b = key_for(800), random_bytes(4096, 80), random_bytes(4096, 81)
    async with running(settings_for(tmp_path, backend=FsBackend(root=tmp_path / "blocks", fsync=True))) as gw:
        assert (await gw.client.put(f"/v1/blocks/{key}", content=a)).status_code == 201
        real_fsync = os.fsync
        directory = str((tmp_path / "blocks" / key).parent)

        def failing(fd: int) -> None:
            if os.readlink(f"/proc/self/fd/{fd}") == directory:
                raise OSError(5, "Input/output error")
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", failing)
        r = await gw.client.put(f"/v1/blocks/{key}", content=b)
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert r.status_code == 503, r.text
        got = await gw.client.get(f"/v1/blocks/{key}")
        assert got.status_code == 200
        assert got.content in (a, b) and matches(got.headers["etag"], got.content)
        head = await gw.client.head(f"/v1/blocks/{key}")
        assert head.status_code == 200 and head.headers["etag"] == got.headers["etag"]


async def test_an_acknowledged_delete_has_fsynced_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a directory fsync the unlink can be lost in a power cut; the start-up reconcile then adopts the
    file again and undoes the DELETE."""
    from tests.inprocess.harness import running, settings_for

    key = key_for(900)
    async with running(settings_for(tmp_path, backend=FsBackend(root=tmp_path / "blocks", fsync=True))) as gw:
        assert (await gw.client.put(f"/v1/blocks/{key}", content=b"d" * 4096)).status_code == 201
        synced: list[str] = []
        real_fsync = os.fsync

        def recording(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real_fsync(fd)

        monkeypatch.setattr(os, "fsync", recording)
        assert (await gw.client.delete(f"/v1/blocks/{key}")).status_code == 204
        assert str((tmp_path / "blocks" / key).parent) in synced


# -- abandoned uploads ------------------------------------------------------------------------------------------


def test_a_running_gateway_drops_abandoned_uploads_and_evicts_them(tmp_path: Path) -> None:
    """A TP rank that died mid-object leaves a part behind: it counts against capacity, the running gateway drops
    it once idle for ``stale_upload_s``, and before that eviction frees it when room is needed (an earlier design
    kept such parts until a restart or a gc, and answered 507 once they filled the bound)."""
    env = {"KVGATE_MAX_BYTES": str(8 * BLOCK), "KVGATE_STALE_UPLOAD_S": "3", "KVGATE_EVICTION_INTERVAL_S": "0.2"}
    gw = Gateway(tmp_path / "data", env=env).start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            whole = random_bytes(8 * BLOCK, 7)
            part = {"Content-Range": f"bytes 0-{6 * BLOCK - 1}/{8 * BLOCK}"}
            assert c.put(f"/v1/blocks/{key_for(1000)}", content=whole[: 6 * BLOCK], headers=part).status_code == 202
            assert c.get("/v1/stats").json()["usage_bytes"] == 6 * BLOCK
            for i in range(4):  # room is needed: the idle upload is the least recently used thing stored
                r = c.put(f"/v1/blocks/{key_for(1001 + i)}", content=random_bytes(BLOCK, 1001 + i))
                assert r.status_code == 201, r.text
            stats = c.get("/v1/stats").json()
            assert stats["usage_bytes"] <= 8 * BLOCK and stats["evictions"] >= 1
            assert (
                c.put(
                    f"/v1/blocks/{key_for(1010)}",
                    content=whole[: 2 * BLOCK],
                    headers={"Content-Range": f"bytes 0-{2 * BLOCK - 1}/{8 * BLOCK}"},
                ).status_code
                == 202
            )
            deadline = time.monotonic() + 60
            while c.get("/v1/stats").json()["usage_bytes"] > 4 * BLOCK and time.monotonic() < deadline:
                time.sleep(0.2)  # bounded wait for the background sweep, not a measure of its speed
            assert c.get("/v1/stats").json()["usage_bytes"] == 4 * BLOCK
        parts = sqlite3.connect(gw.data_dir / "index.db").execute("SELECT COUNT(*) FROM parts").fetchone()[0]
        assert parts == 0
        assert not [p for p in (gw.data_dir / "blocks" / "_parts").rglob("*") if p.is_file()]
    finally:
        gw.stop()
