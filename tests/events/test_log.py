"""The event log in the index (SQLite file and PostgreSQL server): a row iff its change committed, written in the
change's own transaction; numbers persisted with the batches (a new publisher goes on where the last one stopped, and
one that lost its turn writes nothing); PostgreSQL's ids that commit out of order are never skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import inspect, text

from alembic import command
from app.events.model import Batch
from app.events.publisher import LostTurn, Publisher
from app.events.setup import model_lookup
from app.events.wire import ModelNames, Topics
from app.index import ABSENT, Index, make_engine
from app.index.eventlog import STORED, Horizon, Snapshot
from app.index.migrate import alembic_config, upgrade_head
from tests.conftest import key_for
from tests.events.log_harness import FIRST_SEQ, log_index, note, record


@pytest.fixture
async def index(index_url: str) -> AsyncIterator[Index]:
    async with log_index(index_url) as idx:
        yield idx


class Sent:
    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def send(self, batch: Batch) -> None:
        self.batches.append(batch)

    def keys(self) -> list[tuple[str, str]]:
        return [(e.kind, e.key) for b in self.batches for e in b.events]


async def _rows(index: Index) -> list[tuple[int, str]]:
    rows = await index.event_log.rows(after=0, upto=1 << 62, limit=1000)
    return [(r.kind, r.key) for r in rows]


async def test_a_row_iff_the_change_committed(index: Index) -> None:
    a, b = key_for(1), key_for(2)
    assert (await index.swap_block(record(a, digest="a" * 64, stamp="s1"))).written
    assert not (await index.swap_block(record(a, digest="a" * 64, stamp="s2"))).written  # the same bytes
    assert not (await index.swap_block(record(a, digest="b" * 64), expect=ABSENT)).written  # create-only, present
    assert not (await index.swap_block(record(a, digest="b" * 64), expect="other")).written  # not the version seen
    assert (await index.swap_block(record(a, digest="a" * 64, stamp="s3"), expect="s1")).written  # a re-stamp
    assert (await index.swap_block(record(a, digest="c" * 64, size=2), note=note(1, 2))).written
    assert await index.remove_block(b) is None  # nothing there
    assert await index.remove_block(a, expect="s1") is None  # not the version seen
    assert await index.remove_block(a) is not None
    rows = await index.event_log.rows(after=0, upto=1 << 62, limit=100)
    assert [(r.kind, r.key, r.digest, r.meta) for r in rows] == [
        (STORED, a, "a" * 64, None),
        (STORED, a, "c" * 64, "tokens=1,2"),
        (1, a, "c" * 64, None),
    ]


async def test_events_off_write_no_rows(index_url: str, tmp_path: Path) -> None:
    async with log_index(index_url) as index:
        index.event_log.enabled = False
        await index.swap_block(record(key_for(1)))
        await index.remove_block(key_for(1))
        assert await _rows(index) == []


async def test_numbers_go_on_across_publishers_and_a_stale_one_writes_nothing(index: Index) -> None:
    first, second = Sent(), Sent()
    old = Publisher(index=index, sinks=[first])
    await old.resume()
    for i in range(3):
        await index.swap_block(record(key_for(i)))
        assert await old.round() == 1
    assert [b.seq for b in first.batches] == [FIRST_SEQ, FIRST_SEQ + 1, FIRST_SEQ + 2]

    new = Publisher(index=index, sinks=[second])  # another process takes over (a restart, a standby)
    await new.resume()
    await index.swap_block(record(key_for(3)))
    with pytest.raises(LostTurn):
        await old.round()  # it has not noticed: nothing it does is stored, nothing is sent
    assert len(first.batches) == 3
    assert await new.round() == 1
    assert [b.seq for b in second.batches] == [FIRST_SEQ + 3]  # no jump, no reuse
    assert second.keys() == [("stored", key_for(3))]
    state = await index.event_log.state()
    assert state is not None and (state.next_seq, state.last_id) == (FIRST_SEQ + 4, 4)


async def test_a_purge_s_rows_go_under_the_model_s_topic_when_the_publisher_first_meets_them(index: Index) -> None:
    """A publisher that takes its turn (a restart) and first meets a namespace in the rows of its purge, read after
    the purge removed the config, still names the model in their topic: it learned every configured namespace's
    model when it took its turn (they went out under the namespace's own name, and a router kept the blocks)."""
    key = key_for(1)
    namespace = key.split("_r0/")[0]
    await index.put_namespace(name=namespace, fields={"model_name": "org/model-x"})
    await index.swap_block(record(key))

    async def model_name(ns: str) -> str | None:
        found = await index.get_namespace(ns)
        name = found.fields.get("model_name") if found is not None else None
        return name if isinstance(name, str) else None

    sent = Sent()
    topics = Topics()
    publisher = Publisher(index=index, topics=topics, models=ModelNames(model_name), sinks=[sent])
    await publisher.resume()
    await index.remove_block(key)  # the purge: the blocks' rows, then the config
    await index.delete_namespace(namespace)
    assert await publisher.round() == 1
    assert sent.keys() == [("stored", key), ("removed", key)]
    assert [b.topic for b in sent.batches] == [topics.render(namespace=namespace, model="org/model-x")]


async def test_a_purge_s_rows_name_the_model_of_a_config_the_publisher_never_read(index: Index) -> None:
    """A namespace configured in another process after the publisher took its turn (so neither told nor loaded), its
    blocks stored and purged (rows, then config) before the publisher read any of them: its config's removal left
    the model's name in the log, and the rows go out under the model's topic. Before, the publisher found no config
    and sent them under the namespace's own name (a router kept the blocks)."""
    key = key_for(1)
    namespace = key.split("_r0/")[0]
    sent = Sent()
    topics = Topics()
    publisher = Publisher(index=index, topics=topics, models=ModelNames(model_lookup(index)), sinks=[sent])
    await publisher.resume()
    await index.put_namespace(name=namespace, fields={"model_name": "org/model-y"})  # another process
    await index.swap_block(record(key))
    await index.remove_block(key)  # the purge: the blocks' rows, then the config
    assert await index.delete_namespace(namespace)
    assert await model_lookup(index)(namespace) == "org/model-y"  # a round that reads the rows and not the config's
    assert await publisher.round() == 1
    assert sent.keys() == [("stored", key), ("removed", key)]
    assert [b.topic for b in sent.batches] == [topics.render(namespace=namespace, model="org/model-y")]
    assert publisher.dropped == 0


async def test_held_rows_wait_for_the_puts_of_their_parent_across_a_restart(index: Index) -> None:
    parent, child, grandchild, other = key_for(1), key_for(2), key_for(3), key_for(4)
    h = {k: k.rsplit("/", 1)[1].removesuffix(".bin") for k in (parent, child, grandchild)}
    sent = Sent()
    publisher = Publisher(index=index, sinks=[sent])
    await publisher.resume()
    await index.swap_block(record(child), note=note(3, parent=h[parent], waits_for=(7,)))
    await index.swap_block(record(grandchild), note=note(5, parent=h[child]))  # behind its parent
    await index.swap_block(record(other))
    await publisher.round()
    assert sent.keys() == [("stored", other)]

    publisher = Publisher(index=index, sinks=[sent])  # a restart: the held rows are read again
    await publisher.resume()
    await index.swap_block(record(parent, digest="e" * 64), note=note(1, token=8))  # not that PUT
    await publisher.round()
    assert sent.keys() == [("stored", other), ("stored", parent)]
    await index.swap_block(record(parent), note=note(1, token=7))
    await publisher.round()
    assert sent.keys() == [
        ("stored", other),
        ("stored", parent),
        ("stored", parent),
        ("stored", child),
        ("stored", grandchild),
    ]

    await index.swap_block(record(child, digest="f" * 64), note=note(3, parent=h[parent], waits_for=(9,)))
    await publisher.round()
    assert sent.keys()[-1] == ("stored", grandchild)
    await index.event_log.release(parent, token=9)  # that PUT of the parent ended without a store
    await publisher.round()
    assert sent.keys()[-1] == ("stored", child)


async def test_a_child_held_behind_its_held_parent_stays_behind_it_across_a_restart(index: Index) -> None:
    """The child committed first, waiting for its parent's PUT; the parent's row came, itself waiting for the
    grandparent's PUT: both are held, the child behind the parent. A restart reads the held rows again in the log's
    order, the child first: it must be held again behind its parent, which is held again (before the fix the child
    went out at once, ahead of its parent: a router drops or misfiles it)."""
    grandparent, parent, child = key_for(1), key_for(2), key_for(3)
    h = {k: k.rsplit("/", 1)[1].removesuffix(".bin") for k in (grandparent, parent)}
    sent = Sent()
    publisher = Publisher(index=index, sinks=[sent])
    await publisher.resume()
    await index.swap_block(record(child), note=note(5, parent=h[parent], waits_for=(8,)))
    await index.swap_block(record(parent), note=note(3, parent=h[grandparent], waits_for=(7,), token=8))
    await publisher.round()
    assert sent.keys() == []

    publisher = Publisher(index=index, sinks=[sent])  # a restart, or another replica taking over
    await publisher.resume()
    await publisher.round()
    assert sent.keys() == []
    await index.swap_block(record(grandparent), note=note(1, token=7))
    await publisher.round()
    assert sent.keys() == [("stored", grandparent), ("stored", parent), ("stored", child)]


async def test_a_held_row_goes_after_events_hold_s_without_its_parent(index: Index) -> None:
    sent = Sent()
    publisher = Publisher(index=index, sinks=[sent], hold_s=0.0)
    await publisher.resume()
    parent_hash = key_for(1).rsplit("/", 1)[1].removesuffix(".bin")
    await index.swap_block(record(key_for(2)), note=note(3, parent=parent_hash, waits_for=(5,)))
    await publisher.round()  # read and held; the wait is over at once
    await publisher.round()
    assert sent.keys() == [("stored", key_for(2))]


def test_horizon() -> None:
    h = Horizon()
    assert h.advance(Snapshot(xmin=10, xmax=10, max_id=5)) == 5  # nothing running: all final
    assert h.advance(Snapshot(xmin=11, xmax=14, max_id=9)) == 5  # 11..13 may hold ids below 9
    assert h.advance(Snapshot(xmin=12, xmax=15, max_id=12)) == 5
    assert h.advance(Snapshot(xmin=14, xmax=16, max_id=13)) == 9  # all of the first snapshot's have ended
    assert h.advance(Snapshot(xmin=16, xmax=17, max_id=14)) == 13
    assert h.advance(Snapshot(xmin=17, xmax=17, max_id=14)) == 14


async def test_postgresql_ids_committed_out_of_order_are_not_skipped(pg_url: str) -> None:
    """Transaction A takes log id n and commits after transaction B took n + 1 and committed. A reader that takes
    "every id above the last seen" would publish n + 1 and never n; the publisher waits until A has ended and then
    publishes n, n + 1, in the log's order."""
    import asyncpg  # type: ignore[import-untyped]

    from tests.services import asyncpg_dsn

    async with log_index(pg_url) as index:
        sent = Sent()
        publisher = Publisher(index=index, sinks=[sent])
        await publisher.resume()
        slow, fast = key_for(1), key_for(2)
        other: Any = await asyncpg.connect(asyncpg_dsn(pg_url))  # another replica's transaction, slow to commit
        try:
            tx = other.transaction()
            await tx.start()
            await other.execute(
                "INSERT INTO blocks (key, namespace, rank, grp, size, digest, created_at, last_access, hits) "
                "VALUES ($1, $2, 0, 0, 1, $3, 0, 0, 0)",
                slow,
                slow.split("_r0/")[0],
                "0" * 64,
            )
            await other.execute("INSERT INTO event_log (kind, key, size, digest) VALUES (0, $1, 1, $2)", slow, "0" * 64)
            await index.swap_block(record(fast))  # commits now, with the next id
            async with index.engine.connect() as conn:
                visible = [r[0] for r in await conn.execute(text("SELECT id FROM event_log ORDER BY id"))]
            assert len(visible) == 1  # the slow one's id is taken, not visible: "above the last seen" skips it
            assert await publisher.round() == 0
            assert sent.batches == []
            await tx.commit()
        finally:
            await other.close()
        while await publisher.round():
            pass
        assert sent.keys() == [("stored", slow), ("stored", fast)]


async def test_postgresql_an_id_held_by_a_transaction_newer_than_every_ended_one_is_not_skipped(pg_url: str) -> None:
    """PostgreSQL's snapshot ends at the newest transaction that has ended: one that began writing after it and still
    runs is in no snapshot's list, nor below its xmin. Here B begins writing first, A after it; A takes log id n, B
    takes n + 1 and commits. Every snapshot now says "nothing running" (xmin = xmax = B + 1) while A, running,
    holds n: a reader that trusted it published n + 1 and never n. The publisher waits until A has ended."""
    import asyncpg  # type: ignore[import-untyped]

    from tests.services import asyncpg_dsn

    def block_row(key: str) -> tuple[Any, ...]:
        sql = (
            "INSERT INTO blocks (key, namespace, rank, grp, size, digest, created_at, last_access, hits) "
            "VALUES ($1, $2, 0, 0, 1, $3, 0, 0, 0)"
        )
        return sql, key, key.split("_r0/")[0], "0" * 64

    async with log_index(pg_url) as index:
        sent = Sent()
        publisher = Publisher(index=index, sinks=[sent])
        await publisher.resume()
        a_key, b_key = key_for(1), key_for(2)
        a: Any = await asyncpg.connect(asyncpg_dsn(pg_url))
        b: Any = await asyncpg.connect(asyncpg_dsn(pg_url))
        try:
            b_tx, a_tx = b.transaction(), a.transaction()
            await b_tx.start()
            await b.execute(*block_row(b_key))  # B takes its transaction id first
            await a_tx.start()
            await a.execute(*block_row(a_key))  # A after it: a newer one
            log = "INSERT INTO event_log (kind, key, size, digest) VALUES (0, $1, 1, $2) RETURNING id"
            a_id = await a.fetchval(log, a_key, "0" * 64)
            b_id = await b.fetchval(log, b_key, "0" * 64)
            assert b_id == a_id + 1
            await b_tx.commit()
            running = await b.fetchval("SELECT pg_current_snapshot()::text")
            a_xid = await a.fetchval("SELECT pg_current_xact_id()::text")
            xmin, xmax, _ = running.split(":")
            assert int(xmin) == int(xmax) <= int(a_xid)  # A is newer than the snapshot's end: "nothing running"
            await publisher.round()
            assert sent.keys() == []  # before the fix: [("stored", b_key)], and a_key's row never went out
            await a_tx.commit()
        finally:
            await a.close()
            await b.close()
        while await publisher.round():
            pass
        assert sent.keys() == [("stored", a_key), ("stored", b_key)]


async def test_0007_adds_the_model_to_a_0006_log_in_place(index_url: str) -> None:
    """A log written at revision 0006 migrates in place (its rows kept, no model), and back."""
    cfg = alembic_config(index_url)
    await asyncio.to_thread(command.upgrade, cfg, "0006")
    engine = make_engine(index_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO event_log (kind, key, size, digest) VALUES (0, 'k', 1, 'd')"))
        await upgrade_head(index_url)
        async with engine.connect() as conn:
            columns = await conn.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns("event_log")})
            indexes = await conn.run_sync(lambda c: {i["name"] for i in inspect(c).get_indexes("event_log")})
            rows = (await conn.execute(text("SELECT kind, key, model FROM event_log"))).all()
        assert "model" in columns and "ix_event_log_config" in indexes
        assert [tuple(r) for r in rows] == [(0, "k", None)]
        await asyncio.to_thread(command.downgrade, cfg, "0006")
        async with engine.connect() as conn:
            columns = await conn.run_sync(lambda c: {col["name"] for col in inspect(c).get_columns("event_log")})
            assert (await conn.execute(text("SELECT count(*) FROM event_log"))).scalar_one() == 1
        assert "model" not in columns
    finally:
        await engine.dispose()
