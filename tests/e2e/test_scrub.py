"""The scrub (issue 41): bytes changed on disk without a write (bit rot: the file's stamp and mtime unchanged, so
no reader can tell from the file) are found by reading them back, quarantined, their rows removed (a miss from then
on) and announced with a BlockRemoved event; progress and findings in /metrics; ``kvgate scrub`` for an operator."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.capacity.helpers import block_files, index_rows
from tests.conftest import key_for, random_bytes
from tests.events.helpers import events_gateway, hello, read_batches
from tests.gateway import REPO, Gateway

BLOCK = 256 * 1024


def _rot(path: Path, *, at: int) -> None:
    """Flip one bit of the file in place and put its mtime back: what a disk does, not what a writer does."""
    st = path.stat()
    with path.open("r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x01]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _kvgate(*args: str, data_dir: Path) -> dict[str, Any]:
    """``kvgate ARGS`` on ``data_dir`` (it must succeed): its JSON report."""
    out = subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(data_dir)},
        capture_output=True,
        timeout=120,
        check=True,
    )
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


def test_the_scrub_finds_a_flipped_bit_quarantines_it_and_announces_the_removal(tmp_path: Path) -> None:
    env = {"KVGATE_SCRUB_INTERVAL_S": "0.5", "KVGATE_SCRUB_DELAY_S": "0"}
    gw = events_gateway(tmp_path / "data", env=env).start()
    rotten, sound = key_for(1), key_for(2)
    bodies = {rotten: random_bytes(BLOCK, 1), sound: random_bytes(BLOCK, 2)}
    try:
        first = hello(gw.url)["next_seq"]
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, body in bodies.items():
                assert c.put(f"/v1/blocks/{key}", content=body).status_code == 201
            _rot(gw.data_dir / "blocks" / rotten, at=BLOCK // 3)
            deadline = time.monotonic() + 60
            while _metric(c.get("/metrics").text, "kvgate_scrub_corrupt_total") < 1:
                assert time.monotonic() < deadline, "the scrub did not find the flipped bit"
                time.sleep(0.2)  # bounded wait for the background pass, not a measure of its speed
            metrics = c.get("/metrics").text
            assert _metric(metrics, "kvgate_scrub_bytes_total") >= BLOCK
            assert _metric(metrics, "kvgate_scrub_blocks_total") >= 1  # the sound block, intact
            assert (c.get(f"/v1/blocks/{rotten}").status_code, c.head(f"/v1/blocks/{rotten}").status_code) == (404, 404)
            assert not c.post("/v1/lookup", json={"keys": [rotten]}).json()["blocks"][0]["present"]
            got = c.get(f"/v1/blocks/{sound}")
            assert (got.status_code, got.content) == (200, bodies[sound])
        events = [e for b in read_batches(gw.url, since=first, events=3) for e in b["events"]]
        assert ("BlockRemoved", rotten) in [(e["type"], e["key"]) for e in events]
        assert index_rows(gw.data_dir) == block_files(gw.data_dir) == {sound: BLOCK}
        assert len(list((gw.data_dir / "blocks").rglob(".kvgate-corrupt-*"))) == 1  # kept aside, never served
        gw.stop()
        gw.start()  # a restart adopts nothing of it
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.get(f"/v1/blocks/{rotten}").status_code == 404
    finally:
        gw.stop()


def test_kvgate_scrub_finds_a_flipped_bit_beside_a_running_gateway(tmp_path: Path) -> None:
    gw = events_gateway(tmp_path / "data").start()  # no background pass in a test's time (the default delay)
    key, body = key_for(3), random_bytes(BLOCK, 3)
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert c.put(f"/v1/blocks/{key}", content=body).status_code == 201
            assert c.put(f"/v1/blocks/{key_for(4)}", content=random_bytes(BLOCK, 4)).status_code == 201
            _rot(gw.data_dir / "blocks" / key, at=0)
            report = _kvgate("scrub", "--json", data_dir=gw.data_dir)
            assert (report["corrupt"], report["blocks"], report["bytes"]) == (1, 1, 2 * BLOCK)
            assert c.get(f"/v1/blocks/{key}").status_code == 404
            assert c.get(f"/v1/blocks/{key_for(4)}").status_code == 200
    finally:
        gw.stop()


def _orphan(data_dir: Path, *keys: str) -> None:
    """Remove the keys' rows and leave their files: what a crash between a file's rename and its row's commit, or a
    lost index, leaves for ``kvgate import`` and the start-up reconcile to adopt."""
    with sqlite3.connect(data_dir / "index.db") as conn:
        conn.executemany("DELETE FROM blocks WHERE key = ?", [(k,) for k in keys])


@pytest.mark.parametrize("adopter", ["import", "restart"])
def test_a_rotten_file_without_a_row_is_quarantined_not_adopted(tmp_path: Path, adopter: str) -> None:
    """A file kvgate wrote carries the checksum it was written with (beside its stamp): bytes that rotted while no
    row named them are not adopted under a fresh checksum that would vouch for them; they are moved aside."""
    gw = Gateway(tmp_path / "data").start()
    rotten, sound = key_for(5), key_for(6)
    bodies = {rotten: random_bytes(BLOCK, 5), sound: random_bytes(BLOCK, 6)}
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, body in bodies.items():
                assert c.put(f"/v1/blocks/{key}", content=body).status_code == 201
        gw.stop()
        _orphan(gw.data_dir, rotten, sound)
        _rot(gw.data_dir / "blocks" / rotten, at=BLOCK // 2)
        if adopter == "import":
            report = _kvgate("import", str(gw.data_dir / "blocks"), data_dir=gw.data_dir)
            assert (report["blocks"], report["corrupt"]) == (1, 1), report
        gw.start()
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            assert (c.get(f"/v1/blocks/{rotten}").status_code, c.head(f"/v1/blocks/{rotten}").status_code) == (404, 404)
            got = c.get(f"/v1/blocks/{sound}")
            assert (got.status_code, got.content) == (200, bodies[sound])
        assert index_rows(gw.data_dir) == {sound: BLOCK}
        assert len(list((gw.data_dir / "blocks").rglob(".kvgate-corrupt-*"))) == 1
    finally:
        gw.stop()
