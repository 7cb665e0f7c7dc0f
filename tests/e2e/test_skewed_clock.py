"""No decision depends on two machines' clocks: ``kvgate gc`` on a host whose clock runs ahead (libfaketime for that
process only: 30 minutes against moto; 14 against SeaweedFS, which like AWS refuses a SigV4 request signed more than
15 minutes off, so a host further off cannot reach a real store at all), beside a gateway that has staged a write
and not committed it yet, over one PostgreSQL index and an S3-compatible server. The gateway is held between its
staging and its commit by the key's stripe lock in its coordination file, taken by this test (a real lock, as
another process of the machine takes it).

Before staging intents (app/index/staging.py), gc judged a staged object's age by its own clock against the store's
``LastModified``: it removed the object, the PUT answered 201, and GET answered 404; an upload's first part was
dropped as idle, so the object never completed."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import glob
import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import httpx
import pytest

from app.core.coordination import stripe_of
from loopback.s3_servers import S3_CREDS, S3TestServer
from tests.conftest import key_for, matches, random_bytes
from tests.gateway import REPO, Gateway
from tests.services import asyncpg_dsn, require_or_skip, unique_bucket

AHEAD_MIN = {"moto": 30, "seaweedfs": 14}
STALE_S = "300"
"""gc's bound for stale uploads (5 minutes; unnamed versions: 10), inside what its clock runs ahead."""
_FLOCK = struct.Struct("@hhqqi4x")


def _faketime() -> str:
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    if not found:
        require_or_skip("libfaketime not installed (apt-get install -y faketime)")
    return found[0]


@contextlib.contextmanager
def _holding(gw: Gateway, key: str) -> Iterator[None]:
    """Hold ``key``'s stripe lock in the gateway's coordination file (an open-file-description lock)."""
    fd = os.open(gw.data_dir / "kvgate.coord", os.O_RDWR)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, stripe_of(key), 1, 0))
        yield
    finally:
        os.close(fd)  # closing the description releases its lock


def _objects(server: S3TestServer, bucket: str, prefix: str) -> list[str]:
    s3 = boto3.client(
        "s3",
        endpoint_url=server.url,
        region_name=S3_CREDS["region"],
        aws_access_key_id=S3_CREDS["access_key_id"],
        aws_secret_access_key=S3_CREDS["secret_access_key"],
    )
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


def _wait_for_object(server: S3TestServer, bucket: str, prefix: str) -> None:
    deadline = time.monotonic() + 30
    while not _objects(server, bucket, prefix):
        if time.monotonic() > deadline:
            raise AssertionError(f"no object under {prefix!r}")
        time.sleep(0.05)


def _skewed_gc(tmp_path: Path, env: dict[str, str], *, ahead_min: int) -> dict[str, object]:
    """``kvgate gc`` from another data directory (another host), its clock 30 minutes ahead."""
    skewed = {
        **os.environ,
        **env,
        "PYTHONPATH": str(REPO),
        "KVGATE_DATA_DIR": str(tmp_path / "other-host"),
        "LD_PRELOAD": _faketime(),
        "FAKETIME": f"+{ahead_min}m",
        "FAKETIME_DONT_RESET": "1",
    }
    probe = [sys.executable, "-c", "import time; print(time.time())"]
    ahead = float(subprocess.run(probe, env=skewed, capture_output=True, check=True).stdout) - time.time()
    assert ahead > (ahead_min - 1) * 60, ahead  # the fake clock works
    done = subprocess.run(
        [sys.executable, "-m", "app", "gc", "--json", "--stale-parts-s", STALE_S],
        cwd=REPO,
        env=skewed,
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report: dict[str, object] = json.loads(done.stdout)
    return report


@pytest.fixture
def setup(tmp_path: Path, s3_server: S3TestServer, pg_db: str) -> Iterator[tuple[Gateway, dict[str, str]]]:
    bucket = unique_bucket()
    env = {**s3_server.backend_env(bucket=bucket, prefix="kv"), "KVGATE_DB_URL": pg_db}
    env["TEST_BUCKET"] = bucket
    gw = Gateway(tmp_path / "gw", env=env).start()
    try:
        yield gw, env
    finally:
        gw.stop()


def test_a_staged_put_survives_gc_with_a_clock_ahead(
    tmp_path: Path, s3_server: S3TestServer, setup: tuple[Gateway, dict[str, str]]
) -> None:
    gw, env = setup
    key, blob = key_for(7100), random_bytes(64 * 1024, 7100)
    with ThreadPoolExecutor(1) as pool:
        with _holding(gw, key):
            put = pool.submit(lambda: httpx.put(f"{gw.url}/v1/blocks/{key}", content=blob, timeout=120))
            _wait_for_object(s3_server, env["TEST_BUCKET"], f"kv/{key}")  # staged, waiting for the key
            report = _skewed_gc(tmp_path, env, ahead_min=AHEAD_MIN[s3_server.kind])
        answer = put.result()
    assert answer.status_code == 201, answer.text
    got = httpx.get(f"{gw.url}/v1/blocks/{key}", timeout=30)
    assert got.status_code == 200, (got.status_code, report)
    assert got.content == blob and matches(got.headers["etag"], blob)
    assert answer.headers["etag"] == got.headers["etag"]


def test_an_upload_and_a_staged_part_survive_gc_with_a_clock_ahead(
    tmp_path: Path, s3_server: S3TestServer, setup: tuple[Gateway, dict[str, str]]
) -> None:
    gw, env = setup
    half = 64 * 1024
    key, blob = key_for(7200), random_bytes(3 * half, 7200)

    def part(n: int) -> httpx.Response:
        span = {"Content-Range": f"bytes {n * half}-{(n + 1) * half - 1}/{3 * half}"}
        return httpx.put(f"{gw.url}/v1/blocks/{key}", content=blob[n * half : (n + 1) * half], headers=span, timeout=60)

    assert part(0).status_code == 202
    with ThreadPoolExecutor(1) as pool:
        with _holding(gw, key):
            second = pool.submit(part, 1)
            _wait_for_object(s3_server, env["TEST_BUCKET"], f"kv/_parts/{key}/{half}-")  # staged part
            report = _skewed_gc(tmp_path, env, ahead_min=AHEAD_MIN[s3_server.kind])
        assert second.result().status_code == 202, report
    last = part(2)
    assert last.status_code == 201, (last.text, report)
    got = httpx.get(f"{gw.url}/v1/blocks/{key}", timeout=30)
    assert got.status_code == 200 and got.content == blob and matches(got.headers["etag"], blob)


def test_a_dead_writers_staged_version_is_swept_by_the_index_clock(
    tmp_path: Path, s3_server: S3TestServer, setup: tuple[Gateway, dict[str, str]]
) -> None:
    """A writer killed between its staging and its commit leaves an object and its intent: gc removes both once
    the intent is old by the database's clock (here made old in the database itself), and not before."""
    gw, env = setup
    key, blob = key_for(7400), random_bytes(4096, 7400)
    bucket, db_url = env["TEST_BUCKET"], env["KVGATE_DB_URL"]
    with ThreadPoolExecutor(1) as pool, _holding(gw, key):
        pool.submit(lambda: httpx.put(f"{gw.url}/v1/blocks/{key}", content=blob, timeout=120))
        _wait_for_object(s3_server, bucket, f"kv/{key}")
        gw.kill9()
    gc = [sys.executable, "-m", "app", "gc", "--json", "--stale-parts-s", STALE_S]
    run_env = {**os.environ, **env, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(tmp_path / "gc")}
    young = json.loads(subprocess.run(gc, cwd=REPO, env=run_env, capture_output=True, check=True).stdout)
    assert young["stale_versions_removed"] == 0 and _objects(s3_server, bucket, f"kv/{key}")
    asyncio.run(_sql(db_url, "UPDATE staging SET staged_at = staged_at - 3600"))
    old = json.loads(subprocess.run(gc, cwd=REPO, env=run_env, capture_output=True, check=True).stdout)
    assert old["stale_versions_removed"] == 1 and not _objects(s3_server, bucket, f"kv/{key}")
    assert asyncio.run(_sql(db_url, "SELECT count(*) FROM staging")) == [(0,)]


async def _sql(db_url: str, statement: str) -> list[tuple[object, ...]]:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        return [tuple(r) for r in await conn.fetch(statement)]
    finally:
        await conn.close()
