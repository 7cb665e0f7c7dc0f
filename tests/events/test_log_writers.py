"""Many writers of one PostgreSQL event log at once, as replicas and their tools are: several indexes (each its own
engine and pool, as each gateway process has) changing shared keys, and raw transactions that take their
transaction id, hold their log row's id a random while and then commit or roll back (a replica slow to commit, one
that dies). A publisher tails the log all along, restarted at random points. Whatever the interleaving: every
committed change is published exactly once, none that rolled back is, and each key's changes in their commit order.
The two hand-built orders of tests/events/test_log.py are each one point of this space."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from app.events.publisher import Publisher
from app.index import Index, make_engine
from tests.conftest import key_for
from tests.events.log_harness import log_index, record
from tests.events.test_log import Sent

pytestmark = pytest.mark.postgres

_BLOCK_ROW = (
    "INSERT INTO blocks (key, namespace, rank, grp, size, digest, created_at, last_access, hits) "
    "VALUES ($1, $2, 0, 0, 1, $3, 0, 0, 0)"
)
_LOG_ROW = "INSERT INTO event_log (kind, key, size, digest) VALUES (0, $1, 1, $2)"


@pytest.mark.parametrize("seed", range(8))
async def test_many_writers_every_committed_change_once_in_each_key_s_order(pg_url: str, seed: int) -> None:
    import asyncpg  # type: ignore[import-untyped]

    from tests.services import asyncpg_dsn

    rnd = random.Random(seed)
    shared = [key_for(i) for i in range(8)]
    locks = {k: asyncio.Lock() for k in shared}  # one change of a key at a time: its commit order is the lock's
    made: dict[str, list[str]] = {k: [] for k in shared}  # key -> digests committed, in commit order ("" removed)
    solo: set[tuple[str, str]] = set()  # (key, digest) committed by the raw transactions, a key each
    counter = iter(range(1, 1 << 30))
    stop = asyncio.Event()
    pauses = [0]  # while above 0, the shared keys' writers pause

    async with log_index(pg_url) as index:
        others = [Index(make_engine(pg_url), flush_interval_s=3600, events=True) for _ in range(3)]
        for other in others:
            await other.start()
        writers = [index, *others]

        async def index_writer(w: Index, wrnd: random.Random) -> None:
            while not stop.is_set():
                while pauses[0]:
                    await asyncio.sleep(0.002)
                key = wrnd.choice(shared)
                async with locks[key]:
                    if wrnd.random() < 0.8:
                        digest = f"{next(counter):064x}"
                        swap = await w.swap_block(record(key, digest=digest))
                        assert swap.written
                        made[key].append(digest)
                    elif await w.remove_block(key) is not None:
                        made[key].append("")
                await asyncio.sleep(wrnd.random() * 0.003)

        async def pair_writer(wrnd: random.Random, n: int) -> None:
            """Two transactions at a time, each: take a transaction id (its block row), take a log id, end; the
            six steps in a random order, with the shared keys' writers paused half the time (then one of the two
            may be the newest transaction running while the other commits a larger log id)."""
            conns: list[Any] = [await asyncpg.connect(asyncpg_dsn(pg_url)) for _ in range(2)]
            try:
                for i in range(20):
                    keys = [key_for(1000 + 100 * n + 2 * i + j) for j in range(2)]  # their own: nobody waits
                    digests = [f"{next(counter):064x}" for _ in range(2)]
                    txs = [c.transaction() for c in conns]
                    order = [0, 0, 0, 1, 1, 1]
                    wrnd.shuffle(order)
                    done = [0, 0]
                    pausing = wrnd.random() < 0.5
                    pauses[0] += pausing
                    try:
                        for t in order:
                            step, done[t] = done[t], done[t] + 1
                            if step == 0:
                                await txs[t].start()
                                await conns[t].execute(_BLOCK_ROW, keys[t], keys[t].split("_r0/")[0], digests[t])
                            elif step == 1:
                                await conns[t].execute(_LOG_ROW, keys[t], digests[t])
                            elif wrnd.random() < 0.8:
                                await txs[t].commit()
                                solo.add((keys[t], digests[t]))
                            else:
                                await txs[t].rollback()
                            await asyncio.sleep(wrnd.random() * 0.01)  # publisher rounds run meanwhile
                    finally:
                        pauses[0] -= pausing
            finally:
                for c in conns:
                    await c.close()

        sent = Sent()
        box = {"publisher": Publisher(index=index, sinks=[sent])}
        await box["publisher"].resume()

        async def publishing() -> None:
            while not stop.is_set():
                if rnd.random() < 0.05:  # a restart, or another replica taking over
                    box["publisher"] = Publisher(index=rnd.choice(writers), sinks=[sent])
                    await box["publisher"].resume()
                await box["publisher"].round()
                await asyncio.sleep(rnd.random() * 0.004)

        try:
            fast = [asyncio.create_task(index_writer(w, random.Random(rnd.random()))) for w in writers]
            slow = [asyncio.create_task(pair_writer(random.Random(rnd.random()), n)) for n in range(2)]
            pub = asyncio.create_task(publishing())
            await asyncio.gather(*slow)
            while sum(map(len, made.values())) < 80:  # the shared keys' changes go on past the slow ones
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.gather(*fast, pub)
            while await box["publisher"].round():
                pass
        finally:
            for other in others:
                await other.close()

    out = [(e.key, e.digest or "") for b in sent.batches for e in b.events]
    expected = [(k, d) for k, ds in made.items() for d in ds] + sorted(solo)
    assert solo  # some slow transactions committed (each commits with probability 0.8)
    assert sorted(out) == sorted(expected)  # every committed change once, nothing rolled back, nothing twice
    for key in shared:
        assert [d for k, d in out if k == key] == made[key]  # each key in its commit order
