"""One writer's bad block meta never costs another writer's events, nor a sequence number (issue 26).

``parent=`` with an odd number of hex digits passed the header grammar, committed, and then failed in the ZMQ
encoder: the whole batch (every event made in that loop turn, other writers' too) was lost to ZMQ subscribers and
its number spent, a gap no replay could fill. Each event is now checked and encoded on its own before it is
numbered, and such a parent is refused at the PUT (400), before anything commits.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import httpx

from tests.conftest import key_for
from tests.events.helpers import ZmqTap, events_gateway, h64, joined, read_batches


def test_bad_parent_is_refused_and_costs_no_one_else_an_event_or_a_number(tmp_path: Path) -> None:
    gw = events_gateway(tmp_path / "data").start()
    tap = ZmqTap(gw.pub)  # type: ignore[attr-defined]
    try:
        start = joined(gw.url, tap)
        good: list[str] = []
        statuses: dict[str, list[int]] = {"good": [], "bad": []}

        async def put(http: httpx.AsyncClient, key: str, meta: str, kind: str) -> None:
            resp = await http.put(f"/v1/blocks/{key}", content=key.encode() * 8, headers={"X-KVGate-Block-Meta": meta})
            statuses[kind].append(resp.status_code)

        async def rounds() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
                for r in range(6):
                    batch = []
                    for i in range(16):
                        key = key_for(r * 100 + i)
                        good.append(key)
                        parent = hashlib.sha256(f"p{r}{i}".encode()).hexdigest()
                        batch.append(put(http, key, f"parent={parent}; tokens={r},{i}", "good"))
                    # in the middle of the round's PUTs, so that its event would share their loop turns
                    batch.insert(8, put(http, key_for(5000 + r), "parent=" + "a" * 17 + "; tokens=1", "bad"))
                    await asyncio.gather(*batch)

        asyncio.run(rounds())
        assert statuses["bad"] == [400] * 6  # refused before anything committed
        assert statuses["good"] == [201] * len(good)
        want = {h64(k) for k in good}
        tap.wait(lambda t: want <= {e["block_hashes"][0] for _s, e in t.events()})
        got = [(seq, e) for seq, e in tap.events() if seq >= start]
        assert sorted({e["block_hashes"][0] for _s, e in got}) == sorted(want)  # every good one, none of the bad
        seqs = sorted({seq for seq, _e in got})
        assert seqs == list(range(start, start + len(seqs)))  # no number spent on nothing
        sse = read_batches(gw.url, since=start, events=len(good))
        assert [b["seq"] for b in sse] == seqs  # the JSON stream numbers the same batches
    finally:
        tap.close()
        gw.stop()
