"""Start-up reconcile settles a row whose file is another version than the one the row names, by which is older.

- a file rewritten behind the gateway's back with other bytes (newer than its row) is corruption: row and file go,
  and HEAD, GET and lookup miss; it is never recorded as a good version;
- a file rewritten with the row's own bytes (a copy, a restore) keeps its row;
- a file older than its row is the version before it (kill -9 between the row and the rename): it is recorded and
  served, since it was an acknowledged version, byte for byte.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import httpx

from tests.conftest import key_for, matches, random_bytes, sha
from tests.gateway import Gateway

BLOCK = 64 * 1024


def _file(gw: Gateway, key: str) -> Path:
    return gw.data_dir / "blocks" / key


def test_start_up_settles_rows_in_doubt(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    rotten, copied, crashed, untouched = (key_for(70_000 + i) for i in range(4))
    bodies = {k: random_bytes(BLOCK, i) for i, k in enumerate((rotten, copied, crashed, untouched))}
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for key, data in bodies.items():
                assert c.put(f"/v1/blocks/{key}", content=data).status_code == 201
    finally:
        gw.stop()

    # bit rot written behind the gateway's back: same size, other bytes, a later mtime
    flipped = bytes(b ^ 0xFF for b in bodies[rotten][:16]) + bodies[rotten][16:]
    _file(gw, rotten).write_bytes(flipped)
    # the row's own bytes under a new inode and mtime (restored from a copy)
    path = _file(gw, copied)
    path.unlink()
    path.write_bytes(bodies[copied])
    # kill -9 after the row named the next version and before its rename: the row is newer than the file
    st = os.stat(_file(gw, crashed))
    in_flight = random_bytes(BLOCK, 99)
    db = sqlite3.connect(gw.data_dir / "index.db")
    updated = db.execute(
        "UPDATE blocks SET digest = ?, stamp = ? WHERE key = ?",
        (sha(in_flight), f"{st.st_ino + 1}:{st.st_mtime_ns + 10**9}", crashed),
    ).rowcount
    db.commit()
    db.close()
    assert updated == 1

    gw.start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            look = c.post("/v1/lookup", json={"keys": [rotten, copied, crashed, untouched]}).json()["blocks"]
            present = {b["key"]: b["present"] for b in look}
            assert present == {rotten: False, copied: True, crashed: True, untouched: True}
            assert c.head(f"/v1/blocks/{rotten}").status_code == 404
            assert c.get(f"/v1/blocks/{rotten}").status_code == 404
            assert not _file(gw, rotten).exists()
            for key in (copied, crashed, untouched):
                r = c.get(f"/v1/blocks/{key}")
                assert r.status_code == 200, key
                assert r.content == bodies[key], key
                assert matches(r.headers["etag"], bodies[key])
            stats = c.get("/v1/stats").json()
            assert (stats["blocks"], stats["usage_bytes"]) == (3, 3 * BLOCK)
    finally:
        gw.stop()
