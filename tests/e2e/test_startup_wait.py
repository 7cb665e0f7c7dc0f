"""A gateway started while its PostgreSQL cannot be reached (restarting, a partition, a pod not up yet) waits for it
(``KVGATE_STARTUP_WAIT_S``) and then serves, instead of exiting at its first try; past the wait it exits 3 with
the reason in its log. A real server process, PostgreSQL behind the fault proxy (tests/pg_proxy.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway
from tests.pg_proxy import PgFaultProxy

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def proxy(pg_db: str) -> Iterator[PgFaultProxy]:
    upstream = int(pg_db.rsplit(":", 1)[1].split("/", 1)[0])
    p = PgFaultProxy(upstream_port=upstream, seed=5).start()
    try:
        yield p
    finally:
        p.stop()


def test_a_gateway_started_before_its_postgresql_waits_for_it_then_serves(
    tmp_path: Path, pg_db: str, proxy: PgFaultProxy
) -> None:
    proxy.down = True  # every connection refused: the server is not up yet
    gw = Gateway(tmp_path / "data", env={"KVGATE_DB_URL": proxy.url_for(pg_db), "KVGATE_STARTUP_WAIT_S": "60"})
    down_s = 4.0
    healer = threading.Timer(down_s, proxy.heal)
    healer.start()
    began = time.monotonic()
    try:
        gw.start(timeout_s=60)
        assert time.monotonic() - began >= down_s  # it did wait: nothing answered before the index was there
        key, body = key_for(1), random_bytes(64 * 1024, 1)
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{key}", content=body).status_code == 201
            got = c.get(f"/v1/blocks/{key}")
            assert (got.status_code, got.content) == (200, body)
        assert "trying again" in gw.log()
    finally:
        healer.cancel()
        gw.stop()


def test_past_its_wait_a_gateway_exits_3_and_says_why(tmp_path: Path, pg_db: str, proxy: PgFaultProxy) -> None:
    proxy.down = True
    gw = Gateway(tmp_path / "data", env={"KVGATE_DB_URL": proxy.url_for(pg_db), "KVGATE_STARTUP_WAIT_S": "2"})
    with pytest.raises(RuntimeError, match="exited with 3") as failed:
        gw.start(timeout_s=60)
    assert "trying again" in str(failed.value)  # it tried more than once before giving up
