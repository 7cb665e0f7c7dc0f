"""The history checker, short (CI): a filesystem gateway killed -9 at random points with ``kvgate gc`` and
``kvgate import`` beside it; two replicas over SeaweedFS and PostgreSQL, one killed -9 at random points and
restarted with its start-up reconcile. ``python -m benchmarks.history`` runs the same for longer."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.e2e.history_runs import run_fs, run_replicas
from tests.services import PgServer, SeaweedServer, asyncpg_dsn, unique_bucket

SECONDS = float(os.environ.get("KVGATE_HISTORY_SECONDS", "40"))


def test_history_fs_with_gc_import_and_kill9(tmp_path: Path) -> None:
    report = run_fs(tmp_path, seconds=SECONDS, seed=7)
    print("\n".join(report.lines()))
    assert report.kills >= 2 and report.tools["gc"] >= 2
    assert report.verdict.problems == []
    assert report.verdict.ops["put ok"] > 30 and report.verdict.reads > 60


def test_history_replicas_on_seaweedfs_and_postgresql(
    tmp_path: Path, seaweedfs_server: SeaweedServer, pg_server: PgServer
) -> None:
    db_url = asyncio.run(pg_server.create_database())
    bucket, prefix = unique_bucket(), "kv"
    env = {**seaweedfs_server.backend_env(bucket=bucket, prefix=prefix), "KVGATE_DB_URL": db_url}

    def rows_of() -> dict[str, tuple[int, str | None]]:
        async def q() -> dict[str, tuple[int, str | None]]:
            import asyncpg  # type: ignore[import-untyped]

            conn = await asyncpg.connect(asyncpg_dsn(db_url))
            try:
                return {
                    r["key"]: (r["size"], r["stamp"]) for r in await conn.fetch("SELECT key, size, stamp FROM blocks")
                }
            finally:
                await conn.close()

        return asyncio.run(q())

    def part_bytes() -> int:
        async def q() -> int:
            import asyncpg

            conn = await asyncpg.connect(asyncpg_dsn(db_url))
            try:
                return int(await conn.fetchval('SELECT COALESCE(SUM("end" - start), 0) FROM parts'))
            finally:
                await conn.close()

        return asyncio.run(q())

    def has_object(key: str, stamp: str | None, size: int) -> bool:
        async def q() -> bool:
            name = f"{prefix}/{key}" + ("" if stamp is None else f".v{stamp}")
            async with seaweedfs_server.client() as s3:
                try:
                    head = await s3.head_object(Bucket=bucket, Key=name)
                except Exception:
                    return False
                return int(head["ContentLength"]) == size

        return asyncio.run(q())

    try:
        report = run_replicas(
            tmp_path, env=env, rows_of=rows_of, part_bytes=part_bytes, has_object=has_object, seconds=SECONDS, seed=11
        )
    finally:
        asyncio.run(pg_server.drop_database(db_url))
    print("\n".join(report.lines()))
    assert report.kills >= 2
    assert report.verdict.problems == []
    assert report.verdict.ops["put ok"] > 30 and report.verdict.reads > 60


pytestmark = pytest.mark.timeout(600)
