"""A read that runs wholly inside another change of its key must not cache what it read.

The metadata cache is filled by readers only when no change of the key overlapped their index read. A read that
starts after a removal took the key's lock and ends before the removal commits sees the old row; if it cached it,
HEAD would answer 200 for a block that GET and lookup miss, until the entry ages out. In-process and deterministic:
the removal is held between taking the lock and committing, and the read runs in that gap.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator

import pytest

from app.core.assembly import Core
from app.errors import BlockNotFound
from contract.keys import parse_block_key
from tests.conftest import key_for
from tests.inprocess.harness import InProcessGateway


async def _body(data: bytes) -> AsyncIterator[bytes]:
    yield data


@pytest.fixture
def core(gw: InProcessGateway) -> Core:
    return gw.core


@pytest.mark.parametrize("change", ["evict", "delete"])
async def test_read_inside_a_removal_is_not_cached(core: Core, change: str) -> None:
    service = core.service
    key = parse_block_key(key_for(1))
    data = b"x" * 4096
    await service.put(key, _body(data), size=len(data), digest=hashlib.sha256(data).hexdigest(), create_only=False)
    async with core.versions.change(key.path):
        pass  # a change of the key (here an empty one): what the cache held is stale, the next read fills it afresh

    index = core.index
    real_remove = index.remove_block
    entered, release = asyncio.Event(), asyncio.Event()

    async def held_remove(*args: object, **kwargs: object) -> object:
        entered.set()  # the key's lock is held and the row is still there
        await release.wait()
        return await real_remove(*args, **kwargs)  # type: ignore[arg-type]

    index.remove_block = held_remove  # type: ignore[method-assign]
    record = await index.get(key.path)
    assert record is not None
    if change == "evict":
        removal = asyncio.create_task(core.upkeep.evict([record]))
    else:
        removal = asyncio.create_task(service.delete(key))
    await entered.wait()
    during = await service.head(key)  # the old row: the removal has not committed
    assert during.digest == record.digest
    release.set()
    await removal

    assert await index.get(key.path) is None
    with pytest.raises(BlockNotFound):
        await service.head(key)  # not the entry the read inside the removal saw
