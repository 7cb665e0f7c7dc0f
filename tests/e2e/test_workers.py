"""``kvgate serve --workers N`` against real processes: one worker killed (kill -9) under load while the others
serve, S3 + PostgreSQL behind two workers, TLS and SIGHUP through the supervisor, and what it refuses.

The same-key races and the kill -9 of the whole gateway run against two workers in test_races.py, test_crash.py
and test_crash_loop.py (parametrized).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from app.api.middleware.principals import hash_token
from loopback.tls_pki import CA, TlsGateway, client_context
from tests.conftest import key_for, matches, random_bytes, sha
from tests.e2e.races import Ledger, all_served, assert_fs_agrees, assert_stats_exact, while_reading
from tests.e2e.test_races import same_key_writers
from tests.gateway import REPO, Gateway, free_port
from tests.services import SeaweedServer, unique_bucket

BLOCK = 256 * 1024


async def _writer(url: str, ids: list[int], acked: dict[str, str], stop: threading.Event) -> None:
    """PUT each id's block; a connection cut by a dying worker is retried on a new one (as the connector does)."""
    async with httpx.AsyncClient(base_url=url, timeout=20) as c:
        for i in ids:
            if stop.is_set():
                return
            data = random_bytes(BLOCK, i)
            for _ in range(5):
                try:
                    r = await c.put(f"/v1/blocks/{key_for(i)}", content=data)
                except httpx.HTTPError:
                    await asyncio.sleep(0.05)
                    continue
                if r.status_code in (200, 201):
                    acked[key_for(i)] = sha(data)
                break


def test_one_worker_killed_under_load_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """Two workers, 16 writers: one worker is killed (kill -9) twice mid-stream. The supervisor starts another each
    time, the other worker goes on serving, and at the end every acknowledged PUT reads back byte-identical, rows
    and files agree (what the dead worker left half-done was rolled forward or removed), no staged file is left, and
    /v1/stats is the sum of the rows."""
    gw = Gateway(tmp_path / "data", workers=2).start()
    acked: dict[str, str] = {}
    stop = threading.Event()

    async def load() -> None:
        await asyncio.gather(*(_writer(gw.url, list(range(w, 3000, 16)), acked, stop) for w in range(16)))

    t = threading.Thread(target=lambda: asyncio.run(load()))
    try:
        t.start()
        killed: list[int] = []
        for round_ in range(2):
            deadline = time.monotonic() + 60
            while len(acked) < 80 * (round_ + 1) and time.monotonic() < deadline:
                time.sleep(0.05)
            victim = gw.worker_pids()[round_ % 2]
            gw.kill9_worker(victim)
            killed.append(victim)
            deadline = time.monotonic() + 60  # the supervisor starts another; it is serving before the next kill
            while not (gw.all_workers_ready() and victim not in gw.worker_pids()) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert gw.all_workers_ready(), gw.log()[-2000:]
        time.sleep(1.0)
        stop.set()
        t.join(60)
        assert not t.is_alive()
        assert len(acked) >= 160
        assert not set(killed) & set(gw.worker_pids())
        assert gw.log().count("exited with signal 9: starting another") == 2, gw.log()[-2000:]
        with httpx.Client(base_url=gw.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for key, digest in acked.items():
                r = c.get(f"/v1/blocks/{key}")
                assert r.status_code == 200 and sha(r.content) == digest, key
        # a version the dead worker committed but never renamed into place is rolled forward by the reader that
        # finds it missing or by the replacement's reconcile; give the replacement's start-up reconcile its time
        deadline = time.monotonic() + 30
        while [p for p in (gw.data_dir / "blocks").rglob(".kvgate-tmp-*")] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in (gw.data_dir / "blocks").rglob(".kvgate-tmp-*")]
        rows = assert_fs_agrees(gw.data_dir)
        assert set(acked) <= set(rows)
        assert_stats_exact(gw.url, rows)
    finally:
        stop.set()
        t.join(60)
        gw.stop()


def test_two_workers_on_s3_and_postgresql(tmp_path: Path, seaweedfs_server: SeaweedServer, pg_db: str) -> None:
    """Two workers over SeaweedFS and one PostgreSQL index: 12 writers race on 2 keys while readers check every
    answer against its ETag; then 16 create-only PUTs of one new key, 10 rounds: exactly one 201 each round."""
    env = {**seaweedfs_server.backend_env(bucket=unique_bucket(), prefix="kv"), "KVGATE_DB_URL": pg_db}
    gw = Gateway(tmp_path / "data", env=env, workers=2).start()
    try:
        before = gw.worker_cpu()
        keys = [key_for(1), key_for(2)]
        ledger = Ledger()
        writes = same_key_writers([gw.url], keys, ledger, writers=12, sizes=[64 * 1024], puts=12)
        acked = asyncio.run(while_reading(writes, [gw.url], keys, ledger, n=6))
        assert not ledger.errors, (ledger.errors[:10], ledger.statuses)
        with httpx.Client(base_url=gw.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as c:
            for key in keys:
                tags = {c.head(f"/v1/blocks/{key}").headers["etag"] for _ in range(6)}  # fresh connections: both
                got = c.get(f"/v1/blocks/{key}")
                tag = got.headers["etag"]
                assert tags == {tag} and matches(tag, got.content) and tag.strip('"') in acked[key], key

            async def create_only() -> list[int]:
                wins = []
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as ac:
                    for rnd in range(10):
                        key = key_for(10_000 + rnd)
                        bodies = [random_bytes(8192, rnd * 100 + w) for w in range(16)]
                        rs = await asyncio.gather(
                            *(ac.put(f"/v1/blocks/{key}", content=b, headers={"If-None-Match": "*"}) for b in bodies)
                        )
                        codes = [r.status_code for r in rs]
                        assert sorted(set(codes)) == [201, 412], codes
                        wins.append(codes.count(201))
                        winner = next(b for b, r in zip(bodies, rs, strict=True) if r.status_code == 201)
                        assert (await ac.get(f"/v1/blocks/{key}")).content == winner
                return wins

            assert asyncio.run(create_only()) == [1] * 10
            stats = c.get("/v1/stats").json()
            assert stats["blocks"] == 12 and stats["usage_bytes"] == 2 * 64 * 1024 + 10 * 8192, stats
        all_served(gw, before)
    finally:
        gw.stop()


def test_tls_and_sighup_reach_every_worker(tmp_path: Path) -> None:
    """Two workers behind HTTPS: blocks round-trip on connections to both; a token added to the tokens file is
    accepted by both after one SIGHUP to the supervisor (file watching off), and refused by both before."""
    ca = CA()
    d = tmp_path / "pki"
    ca_pem = ca.write(d / "ca.pem")
    cert, key = ca.issue("kvgate", server=True).write(d, "server")
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps([{"name": "ops", "sha256": hash_token("old-token"), "role": "admin"}]))
    env = {
        "KVGATE_TLS_CERTFILE": str(cert),
        "KVGATE_TLS_KEYFILE": str(key),
        "KVGATE_TOKENS_FILE": str(tokens),
        "KVGATE_TOKENS_RELOAD_INTERVAL_S": "0",
    }
    gw = TlsGateway(tmp_path / "data", ca=ca_pem, env=env, workers=2).start()
    ctx = client_context(ca=ca_pem)
    fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per request: the workers take turns
    try:
        before = gw.worker_cpu()
        with httpx.Client(base_url=gw.url, verify=ctx, timeout=30, limits=fresh) as c:
            old = {"Authorization": "Bearer old-token"}
            new = {"Authorization": "Bearer new-token"}
            for i in range(40):
                data = random_bytes(64 * 1024, i)
                assert c.put(f"/v1/blocks/{key_for(i)}", content=data, headers=old).status_code == 201
                assert c.get(f"/v1/blocks/{key_for(i)}", headers=old).content == data
                assert c.get(f"/v1/blocks/{key_for(i)}", headers=new).status_code == 401
            all_served(gw, before)
            tokens.write_text(json.dumps([{"name": "ops", "sha256": hash_token("new-token"), "role": "admin"}]))
            assert gw.proc is not None
            gw.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            answers: list[int] = []
            while time.monotonic() < deadline:
                answers = [c.head(f"/v1/blocks/{key_for(0)}", headers=new).status_code for _ in range(20)]
                if answers == [200] * 20:
                    break
                time.sleep(0.2)
            assert answers == [200] * 20
            assert {c.head(f"/v1/blocks/{key_for(0)}", headers=old).status_code for _ in range(20)} == {401}
    finally:
        gw.stop()


def _serve(args: list[str], env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app", "serve", "--port", str(free_port()), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(tmp_path / "data"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("env", "says"),
    [({"KVGATE_BACKEND__KIND": "memory"}, "memory backend")],
    ids=["memory"],
)
def test_workers_refuse_what_they_cannot_share(tmp_path: Path, env: dict[str, str], says: str) -> None:
    """The memory backend (each worker would hold its own blocks) refuses --workers 2 at start, with exit code 2 and
    one line naming why. (KV events work with workers: tests/events/test_publishers.py.)"""
    proc = _serve(["--workers", "2"], env, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "workers" in proc.stderr and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
