"""Point reads of the index share queries (app/index/batch.py) and still answer each caller with its own row."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.errors import IndexUnavailable
from app.index import Index
from app.index.batch import ReadBatcher
from tests.index.test_index_dialects import index, key, put_row, row  # noqa: F401  (fixtures)


async def test_concurrent_gets_share_queries_and_get_their_own_rows(index: Index) -> None:  # noqa: F811
    for i in range(0, 60, 2):  # even keys present, odd keys absent
        await put_row(index, key=key(i), size=i, digest=f"{i:064x}")
    queries: list[int] = []
    fetch = index.get_many

    async def counting(keys: Sequence[str]) -> dict[str, object]:
        queries.append(len(keys))
        return await fetch(keys)  # type: ignore[return-value]

    index._reads._fetch = counting  # type: ignore[assignment]
    got = await asyncio.gather(*(index.get(key(i % 60)) for i in range(120)))  # each key asked for twice
    for i, record in enumerate(got):
        if (i % 60) % 2:
            assert record is None
        else:
            assert record is not None and record.key == key(i % 60) and record.size == i % 60
    assert len(queries) <= 8 and sum(queries) <= 64, queries  # a few queries, each key once per query


async def test_a_get_after_a_write_sees_it(index: Index) -> None:  # noqa: F811
    async def write_then_read(i: int) -> int | None:
        await put_row(index, key=key(i), size=i + 1, digest=f"{i:064x}")
        record = await index.get(key(i))
        return None if record is None else record.size

    assert await asyncio.gather(*(write_then_read(i) for i in range(40))) == [i + 1 for i in range(40)]


async def test_a_failed_query_fails_every_caller_of_its_batch() -> None:
    started = asyncio.Event()
    release = asyncio.Event()

    async def fetch(keys: Sequence[str]) -> dict[str, int]:
        if keys == ["first"]:
            started.set()
            await release.wait()
            return {"first": 1}
        raise IndexUnavailable("index read failed: down")

    batcher: ReadBatcher[int] = ReadBatcher(fetch)
    first = asyncio.create_task(batcher.get("first"))
    await started.wait()
    waiting = [asyncio.create_task(batcher.get(k)) for k in ("a", "b", "a")]
    await asyncio.sleep(0)
    release.set()
    assert await first == 1
    for task in waiting:
        with pytest.raises(IndexUnavailable):
            await task
    assert batcher._running == set() and batcher._waiting == {}


async def test_get_many_finds_exactly_the_present_keys(index: Index) -> None:  # noqa: F811
    present = {key(i) for i in range(0, 1200, 3)}
    await index.swap_block(row(key=key(0), size=1, digest="0" * 64))
    for k in present - {key(0)}:
        await put_row(index, key=k, size=7, digest="1" * 64)
    asked = [key(i) for i in range(1200)] + [key(3), key(4), 'x"y\\z/\u00e9.bin']  # repeats, a key JSON escapes
    found = await index.get_many(asked)
    assert set(found) == present
    assert found[key(0)].size == 1 and found[key(3)].size == 7 and found[key(3)].key == key(3)
