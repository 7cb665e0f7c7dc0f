"""The history checker, short (CI), with its nemesis (tests/e2e/nemesis.py): a filesystem gateway killed -9 at
random points with ``kvgate gc`` and ``kvgate import`` beside it (each killed -9 now and then), its block files
bit-flipped and truncated behind its back, its coordination file removed under it, every process on a clock of its
own; two replicas over SeaweedFS and PostgreSQL, one killed -9 at random
points and restarted with its start-up reconcile, PostgreSQL behind a fault proxy that loses COMMIT replies and
partitions, SeaweedFS behind one that cuts requests, loses replies and partitions, its objects rotted behind
the gateways' backs. ``python -m tests.e2e.run_history
--nemesis all`` runs the same for longer."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.e2e.history_runs import SharedTruth, run_fs, run_replicas
from tests.services import PgServer, SeaweedServer, unique_bucket

SECONDS = float(os.environ.get("KVGATE_HISTORY_SECONDS", "40"))

pytestmark = pytest.mark.timeout(600)


def test_history_fs_with_gc_import_kill9_and_bit_rot(tmp_path: Path) -> None:
    report = run_fs(tmp_path, seconds=SECONDS, seed=7)
    print("\n".join(report.lines()))
    assert report.verdict.problems == []
    assert report.kills >= 1 and report.tools["gc"] >= 1  # fewer fit the bounded run on a loaded machine
    assert report.faults["bit flip"] + report.faults["truncation"] >= 3
    assert report.verdict.ops["put ok"] > 30 and report.verdict.reads > 60


def test_history_replicas_on_seaweedfs_and_postgresql_with_lost_commits(
    tmp_path: Path, seaweedfs_server: SeaweedServer, pg_server: PgServer
) -> None:
    db_url = asyncio.run(pg_server.create_database())
    truth = SharedTruth(db_url=db_url, s3=seaweedfs_server, bucket=unique_bucket(), prefix="kv")
    env = {**seaweedfs_server.backend_env(bucket=truth.bucket, prefix=truth.prefix), "KVGATE_DB_URL": db_url}
    try:
        report = run_replicas(tmp_path, env=env, truth=truth, seconds=SECONDS, seed=11)
    finally:
        asyncio.run(pg_server.drop_database(db_url))
    print("\n".join(report.lines()))
    assert report.verdict.problems == []
    assert report.kills >= 1  # a gateway that cannot start while PostgreSQL is cut is retried, not killed
    assert report.faults["pg lost COMMIT reply"] + report.faults["pg partition"] >= 3
    assert report.verdict.ops["put ok"] > 30 and report.verdict.reads > 60
