"""The named exclusive sections across processes on PostgreSQL (``GroupCommit.exclusive``: the evictor's round, the
events publisher's turn): however a holder's section ends, the lock is free for another engine afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from sqlalchemy import event

from app.index import Index, make_engine
from app.index.migrate import upgrade_head


@pytest.fixture
async def two(pg_url: str) -> AsyncIterator[tuple[Index, Index]]:
    """Two indexes on one PostgreSQL database, each with its own engine and pool (two replicas)."""
    await upgrade_head(pg_url)
    a, b = Index(make_engine(pg_url), flush_interval_s=3600), Index(make_engine(pg_url), flush_interval_s=3600)
    await a.start()
    await b.start()
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


class Fault(Exception):
    """The section's end failed (a connection error, a statement timeout)."""


@pytest.mark.parametrize("fault", [Fault, asyncio.CancelledError], ids=["failed", "cancelled"])
async def test_a_section_whose_end_fails_leaves_the_lock_free(two: tuple[Index, Index], fault: type) -> None:
    """The first thing A's connection does once its section is over fails (a connection error, a timeout), or its
    task is cancelled there. The lock was a session's (``pg_advisory_lock``), released by an explicit unlock
    whose failure was suppressed, and the connection went back to A's pool still holding it: no other replica
    could evict or publish again (B timed out)."""
    a, b = two
    armed = False

    def fail_once(*_: Any) -> None:
        nonlocal armed
        if armed:
            armed = False
            raise fault("the section's end failed")

    event.listen(a.engine.sync_engine, "before_cursor_execute", fail_once)
    event.listen(a.engine.sync_engine, "rollback", fail_once)

    async def hold() -> None:
        nonlocal armed
        async with a.exclusive("evict"):
            armed = True

    holder = asyncio.create_task(hold())
    await asyncio.wait([holder])
    assert not armed  # the fault fired
    async with asyncio.timeout(10):
        async with b.exclusive("evict"):
            pass
    async with asyncio.timeout(10), a.exclusive("evict"):  # and A takes it again, through the same pool
        pass
