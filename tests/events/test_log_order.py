"""Parents first through the log: the process that commits a child's row marks it held while a PUT of its parent is
in progress there and has not queued its change; the publisher, in rounds at any moment, puts it after the parent's
next row (its store, or the release row of a PUT that stored nothing). Random interleavings, with restarts of the
publisher, over a real SQLite index: every committed change is published once, each key's in commit order, and a
store comes after the stores committed by every PUT of its parent that was in progress when it committed (the
guarantee phase 1 gave in one process)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.events.model import Batch
from app.events.publisher import Publisher
from app.events.writer import EventWriter
from contract.wire import BlockMetaValue
from tests.conftest import key_for
from tests.events.log_harness import log_index, record, sqlite_url


@dataclass(eq=False)
class Put:
    n: int
    key: str
    parent: str | None
    commit: bool
    go: asyncio.Event = field(default_factory=asyncio.Event)
    end: asyncio.Event = field(default_factory=asyncio.Event)
    committed: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None


class Sent:
    def __init__(self) -> None:
        self.batches: list[Batch] = []

    def send(self, batch: Batch) -> None:
        self.batches.append(batch)


@pytest.mark.parametrize("seed", range(25))
def test_random_puts_through_the_log_parents_first(seed: int, tmp_path: Path) -> None:
    rnd = random.Random(seed)
    keys = [key_for(i) for i in range(7)]
    hashes = {k: k.rsplit("/", 1)[1].removesuffix(".bin") for k in keys}

    async def run() -> None:
        async with log_index(sqlite_url(tmp_path)) as index:
            writer = EventWriter(index=index)
            sent = Sent()
            publisher = Publisher(index=index, sinks=[sent])
            await publisher.resume()
            made: list[tuple[str, str]] = []  # (key, digest) of each committed change, in commit order ("" removed)
            open_puts: list[Put] = []
            stored_by: dict[int, str] = {}  # PUT n -> the digest it stored
            must_follow: list[tuple[str, set[int]]] = []  # (child's digest, the parent's PUTs in progress then)

            async def put(p: Put) -> None:
                meta = BlockMetaValue(parent=hashes[p.parent] if p.parent else None, tokens=(p.n,))
                async with writer.writing(p.key, meta) as progress:
                    await p.go.wait()
                    if p.commit:
                        digest = f"{p.n:064x}"
                        rec = record(p.key, digest=digest)
                        swap = await index.swap_block(rec, note=writer.note(p.key, progress))
                        assert swap.written
                        writer.stored(rec, progress)
                        made.append((p.key, digest))
                        stored_by[p.n] = digest
                        if p.parent is not None:
                            puts = {q.n for q in open_puts if q.key == p.parent and q is not p}
                            if puts:
                                must_follow.append((digest, puts))
                    p.committed.set()
                    await p.end.wait()

            for n in range(70):
                roll = rnd.random()
                if roll < 0.3:
                    i = rnd.randrange(len(keys))
                    parent = rnd.choice([None, *keys[:i]])  # chains, no circle
                    p = Put(n, keys[i], parent, commit=rnd.random() < 0.75)
                    p.task = asyncio.get_running_loop().create_task(put(p))
                    open_puts.append(p)
                    await asyncio.sleep(0)  # it enters its bracket
                elif roll < 0.5 and open_puts:
                    p = rnd.choice(open_puts)
                    p.go.set()
                    await p.committed.wait()
                elif roll < 0.65 and open_puts:
                    p = open_puts.pop(rnd.randrange(len(open_puts)))
                    p.go.set()
                    p.end.set()
                    assert p.task is not None
                    await p.task
                elif roll < 0.75:
                    key = rnd.choice(keys)
                    if await index.remove_block(key) is not None:  # eviction, a DELETE: no PUT of it
                        made.append((key, ""))
                elif roll < 0.8:  # a restart, or another process taking over: the held rows are read again
                    publisher = Publisher(index=index, sinks=[sent])
                    await publisher.resume()
                else:
                    await publisher.round()
            for p in open_puts:
                p.go.set()
                p.end.set()
                assert p.task is not None
                await p.task
            while await publisher.round():
                pass

            out = [(e.key, e.digest or "") for b in sent.batches for e in b.events]
            assert sorted(out) == sorted(made)  # each committed change once, nothing else
            for key in keys:
                assert [d for k, d in out if k == key] == [d for k, d in made if k == key]  # each key in commit order
            position = {d: i for i, (_k, d) in enumerate(out) if d}
            for child, puts in must_follow:
                for n in puts & stored_by.keys():
                    assert position[stored_by[n]] < position[child], (seed, child, n)

    asyncio.run(run())
