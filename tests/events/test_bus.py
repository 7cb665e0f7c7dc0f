"""The bus in process: an event the codec refuses is dropped alone, before it is numbered; one batch per topic, the
model named by the namespace's config (looked up once) or by the namespace; a config stored later is learnt."""

from __future__ import annotations

import asyncio

import msgspec

from app.core.events import Batch, EventBus, WriterMeta, writer_meta
from app.core.events_wire import EventCodec, KVEventBatch, ModelNames, Topics
from app.index import BlockRecord
from contract.keys import namespace_for
from tests.conftest import agnostic_fields, key_for

A = namespace_for(agnostic_fields("org-a/model-a"))
B = namespace_for(agnostic_fields("org-b/model-b"))


class Sink:
    def __init__(self, codec: EventCodec) -> None:
        self.codec = codec
        self.sent: list[tuple[int, str, KVEventBatch]] = []

    def send(self, batch: Batch) -> None:
        payload = self.codec.batch(ts=batch.ts, events=[e.wire for e in batch.events])
        self.sent.append((batch.seq, batch.topic, msgspec.msgpack.decode(payload, type=KVEventBatch)))


def record(key: str) -> BlockRecord:
    return BlockRecord(
        key=key,
        namespace=key.split("_r0/")[0],
        rank=0,
        group=0,
        size=1,
        digest="0" * 64,
        created_at=0.0,
        last_access=0.0,
        hits=0,
        stamp=None,
    )


def test_refused_event_dropped_alone_and_batches_split_by_model() -> None:
    looked_up: list[str] = []

    async def lookup(namespace: str) -> str | None:
        looked_up.append(namespace)
        return "org-a/model-a" if namespace == A else None  # B has no config (yet)

    async def run() -> tuple[EventBus, Sink]:
        codec = EventCodec()
        sink = Sink(codec)
        bus = EventBus(sinks=[sink], codec=codec, topics=Topics(), models=ModelNames(lookup))
        first = bus.next_seq
        for i, (ns, parent) in enumerate([(A, "ab" * 8), (B, "a" * 17), (B, None), (A, None), (A, "cd" * 32)]):
            token = writer_meta.set(WriterMeta(token_ids=(i,), parent=parent))  # a parser would refuse "a" * 17
            bus.stored(record(key_for(i, namespace=ns)))
            writer_meta.reset(token)
        await asyncio.sleep(0.05)  # the names are looked up, then the turn's events go out
        assert bus.dropped == 1
        assert [s for s, _t, _b in sink.sent] == [first, first + 1]  # no number spent on the refused one
        bus.namespace_config(B, agnostic_fields("org-b/model-b"))  # B's config arrives
        bus.removed(record(key_for(2, namespace=B)))
        await asyncio.sleep(0.05)
        await bus.close()
        return bus, sink

    bus, sink = asyncio.run(run())
    topics = [t for _s, t, _b in sink.sent]
    assert topics == ["kv@pool:kvgate@org-a/model-a", "kv@pool:kvgate@org-b_model-b", "kv@pool:kvgate@org-b/model-b"]
    tokens = [[e.token_ids for e in b.events if hasattr(e, "token_ids")] for _s, _t, b in sink.sent]
    assert tokens == [[[0], [3], [4]], [[2]], []]  # one batch per model, in commit order; event 1 dropped alone
    assert sorted(looked_up) == sorted([A, B])  # once per namespace
    assert bus.published == 5
