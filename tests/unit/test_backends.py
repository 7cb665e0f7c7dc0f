"""open_backends: the server, import and gc open the store and the index with the same options, the SQLite busy
timeout included (import and gc used to drop it and wait SQLite's default instead)."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.backends import open_backends
from app.config import Settings
from app.index.engine import blocking_twin
from app.tools.importer import ImportReport, import_dir
from tests.conftest import key_for, random_bytes


def settings(tmp_path: Path, **kw: Any) -> Settings:
    return Settings(data_dir=tmp_path / "data", **kw)


async def test_the_index_gets_the_configured_busy_timeout(tmp_path: Path) -> None:
    async with open_backends(settings(tmp_path, sqlite_busy_timeout_s=7.5)) as backends:
        async with backends.index.engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == 7500
        assert (tmp_path / "data" / "index.db").exists()


@pytest.mark.parametrize("mmap_bytes", [0, 64 * 1024 * 1024])
async def test_the_index_gets_the_configured_memory_map(tmp_path: Path, mmap_bytes: int) -> None:
    """Both of the index's engines (the async one, and the blocking twin the group commit and reads run on)."""
    async with open_backends(settings(tmp_path, sqlite_mmap_bytes=mmap_bytes)) as backends:
        async with backends.index.engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA mmap_size"))).scalar() == mmap_bytes
        twin = blocking_twin(backends.index.engine)
        assert twin is not None
        with twin.connect() as sync_conn:
            assert sync_conn.exec_driver_sql("PRAGMA mmap_size").scalar_one() == mmap_bytes


def test_import_honours_the_busy_timeout(tmp_path: Path) -> None:
    """With ``sqlite_busy_timeout_s=0``, an import whose index another process locks half-way gives up at once on
    the locked write; with the busy timeout dropped it waited SQLite's 30 s default instead."""
    cfg = settings(tmp_path, sqlite_busy_timeout_s=0)
    source = tmp_path / "fs-tier"
    for i in (1, 2):
        block = source / key_for(i)
        block.parent.mkdir(parents=True, exist_ok=True)
        block.write_bytes(random_bytes(4096, seed=i))

    lockers: list[sqlite3.Connection] = []

    def lock_after_the_first_block(done: int, _total: int) -> None:
        if done == 1:  # the import's connections are open: another writer takes the lock now
            db = tmp_path / "data" / "index.db"
            lockers.append(sqlite3.connect(db, isolation_level=None, check_same_thread=False, timeout=0))
            lockers[0].execute("BEGIN IMMEDIATE")

    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(
                asyncio.run(import_dir(source=source, settings=cfg, concurrency=1, progress=lock_after_the_first_block))
            )
        except Exception as exc:
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    try:
        worker.join(timeout=20)  # bounded: the configured timeout is 0 s, SQLite's default 30 s
        finished = not worker.is_alive()
    finally:
        for locker in lockers:
            locker.execute("ROLLBACK")
        worker.join(timeout=60)
        for locker in lockers:
            locker.close()
    assert finished, "the import waited on the lock: the configured busy timeout was not applied"
    (report,) = outcome
    assert isinstance(report, ImportReport), report
    assert report.blocks == 1 and report.failed == 1, report
