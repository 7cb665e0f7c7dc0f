"""The publisher in process, over a real index: a row the codec refuses is dropped alone, before it is numbered; one
batch per topic, the model named by the namespace's config (looked up once) or by the namespace; a config stored
later is learnt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec

from app.events.model import Batch
from app.events.publisher import Publisher
from app.events.wire import EventCodec, KVEventBatch, ModelNames, Topics
from app.events.writer import EventWriter
from contract.keys import namespace_for
from tests.conftest import agnostic_fields, key_for
from tests.events.log_harness import log_index, note, record, sqlite_url

A = namespace_for(agnostic_fields("org-a/model-a"))
B = namespace_for(agnostic_fields("org-b/model-b"))


class Sink:
    def __init__(self, codec: EventCodec) -> None:
        self.codec = codec
        self.sent: list[tuple[int, str, KVEventBatch]] = []

    def send(self, batch: Batch) -> None:
        payload = self.codec.batch(ts=batch.ts, events=[e.wire for e in batch.events])
        self.sent.append((batch.seq, batch.topic, msgspec.msgpack.decode(payload, type=KVEventBatch)))


def test_refused_event_dropped_alone_and_batches_split_by_model(tmp_path: Path) -> None:
    looked_up: list[str] = []

    async def lookup(namespace: str) -> str | None:
        looked_up.append(namespace)
        return "org-a/model-a" if namespace == A else None  # B has no config (yet)

    async def run() -> tuple[Publisher, Sink]:
        async with log_index(sqlite_url(tmp_path)) as index:
            codec = EventCodec()
            sink = Sink(codec)
            models = ModelNames(lookup)
            publisher = Publisher(index=index, sinks=[sink], codec=codec, topics=Topics(), models=models)
            writer = EventWriter(index=index, config_stored=models.learn)
            await publisher.resume()
            first = publisher.next_seq
            for i, (ns, parent) in enumerate([(A, "ab" * 8), (B, "a" * 17), (B, None), (A, None), (A, "cd" * 32)]):
                # "a" * 17 is no parent the header grammar reads: that event is dropped alone
                await index.swap_block(record(key_for(i, namespace=ns)), note=note(i, parent=parent))
            await publisher.round()
            assert publisher.dropped == 1
            assert [s for s, _t, _b in sink.sent] == [first, first + 1]  # no number spent on the refused one
            writer.namespace_config(B, agnostic_fields("org-b/model-b"))  # B's config arrives
            assert await index.remove_block(key_for(2, namespace=B)) is not None
            await publisher.round()
            return publisher, sink

    publisher, sink = asyncio.run(run())
    topics = [t for _s, t, _b in sink.sent]
    assert topics == ["kv@pool:kvgate@org-a/model-a", "kv@pool:kvgate@org-b_model-b", "kv@pool:kvgate@org-b/model-b"]
    tokens = [[e.token_ids for e in b.events if hasattr(e, "token_ids")] for _s, _t, b in sink.sent]
    assert tokens == [[[0], [3], [4]], [[2]], []]  # one batch per model, in commit order; event 1 dropped alone
    assert sorted(looked_up) == sorted([A, B])  # once per namespace
    assert publisher.published == 5
