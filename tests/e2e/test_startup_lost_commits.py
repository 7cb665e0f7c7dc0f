"""A replica restarted while its PostgreSQL loses COMMIT replies (the history checker's ``pg`` nemesis) becomes
ready without beginning its start-up again from the top at each loss: a step that may be repeated (a read whose
COMMIT's reply was lost: its outcome is nothing to settle) is tried again in place, and the steps done before it
(the store opened, the migrations, reconcile's listing and its keys) are kept. Begun again from the top, start-up had
to get through every step in one go, and under a steady loss late in a long run, with a long reconcile, it never
did. A real server process, PostgreSQL behind the fault proxy (tests/pg_proxy.py)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, random_bytes
from tests.gateway import Gateway
from tests.pg_proxy import PgFaultProxy

pytestmark = pytest.mark.timeout(240)

KEYS = 40
LOSSES = 3


@pytest.fixture
def proxy(pg_db: str) -> Iterator[PgFaultProxy]:
    upstream = int(pg_db.rsplit(":", 1)[1].split("/", 1)[0])
    p = PgFaultProxy(upstream_port=upstream, seed=17).start()
    try:
        yield p
    finally:
        p.stop()


def _heal_after(proxy: PgFaultProxy, losses: int, stop: threading.Event) -> None:
    while proxy.lost < losses and not stop.wait(0.01):
        pass
    proxy.lose_rate = 0.0


def test_a_lost_reply_at_start_up_is_tried_again_in_place_not_from_the_top(
    tmp_path: Path, pg_db: str, proxy: PgFaultProxy
) -> None:
    gw = Gateway(tmp_path / "data", env={"KVGATE_DB_URL": proxy.url_for(pg_db), "KVGATE_STARTUP_WAIT_S": "60"})
    gw.start()
    bodies = {key_for(i): random_bytes(4096, i) for i in range(KEYS)}
    stop = threading.Event()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, body in bodies.items():
                assert c.put(f"/v1/blocks/{key}", content=body).status_code == 201
        gw.kill9()
        before = len(gw.log())
        # the replies lost: those of start-up's usage read (capacity's first view, read through the group commit),
        # the last step, after reconcile: LOSSES in a row, then none
        proxy.lose_only = re.compile(rb"(?i)\bFROM usage\b")
        proxy.lose_rate = 1.0
        healer = threading.Thread(target=_heal_after, args=(proxy, LOSSES, stop))
        healer.start()
        began = time.monotonic()
        gw.start(timeout_s=90)
        ready_s = time.monotonic() - began
        stop.set()
        healer.join()
        log = gw.log()[before:]
        print(f"ready in {ready_s:.1f} s with {proxy.lost} COMMIT replies lost")
        assert proxy.lost == LOSSES
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, body in bodies.items():
                got = c.get(f"/v1/blocks/{key}")
                assert (got.status_code, got.content) == (200, body)
        begun_again = re.findall(r"start-up: .*; trying again in", log)
        assert begun_again == [], f"start-up begun again from the top {len(begun_again)} times: {begun_again}"
        assert len(re.findall(r"start-up step usage read: CommitUnknown: .*; trying it again", log)) == LOSSES
    finally:
        stop.set()
        proxy.lose_rate = 0.0
        gw.stop()
