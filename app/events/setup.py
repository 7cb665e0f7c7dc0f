"""A gateway process's events, assembled: the writer the core calls, the publisher candidacy, the feed of
``GET /v1/events``. ``kvgate gc`` and ``kvgate import`` need none of it: with events on, their index writes their
changes' rows, and a gateway's publisher sends them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.config import Settings
from app.core.coordination import Coordinator
from app.events.feed import EventFeed
from app.events.model import Batch
from app.events.publisher import Publisher, PublisherRole
from app.events.wire import EventCodec, ModelNames, Topics, WireFormat
from app.events.writer import EventWriter
from app.index import Index

if TYPE_CHECKING:
    from app.events.zmq_outlet import Replays, ZmqPublisher

log = logging.getLogger("kvgate.events")

FIRST_SEQ = 0
"""The number of a new stream's first batch."""


@dataclass(frozen=True, slots=True)
class EventParts:
    """What the core needs before it is built (the writer), and what the writer tells the publisher: a change
    committed here (``wake``), a namespace's model name (``models``)."""

    writer: EventWriter
    models: ModelNames
    wake: asyncio.Event


@dataclass(frozen=True, slots=True)
class Events:
    writer: EventWriter
    feed: EventFeed
    role: PublisherRole


def model_lookup(index: Index) -> Callable[[str], Awaitable[str | None]]:
    """How the publisher finds a namespace's model name (``ModelNames``): from its config, or, once a purge removed
    the config, from the log row of that removal (its blocks' rows may be read after it)."""

    async def model_name(namespace: str) -> str | None:
        record = await index.get_namespace(namespace)
        if record is None:
            return await index.event_log.config_model(namespace)
        name = record.fields.get("model_name")
        return name if isinstance(name, str) else None

    return model_name


async def event_parts(settings: Settings, *, index: Index) -> EventParts | None:
    """The writer and what it tells, with the stream's state created if it has none (None: events off). Its first
    batch is numbered 0, as a vLLM engine numbers its own: a subscriber that starts from 0 (Dynamo's indexer) sees no
    gap in the first batch, and one that comes later asks the replay socket from 0 for what it missed."""
    if not settings.events_enabled:
        return None
    await index.event_log.init(first_seq=FIRST_SEQ)

    models = ModelNames(model_lookup(index))
    wake = asyncio.Event()
    writer = EventWriter(index=index, committed=wake.set, config_stored=models.learn)
    return EventParts(writer=writer, models=models, wake=wake)


def only_topic(replays: Replays, topic: str) -> Replays:
    """The batches of ``replays`` of one topic."""

    async def replay(first: int) -> AsyncIterator[Batch]:
        async for batch in replays(first):
            if batch.topic == topic:
                yield batch

    return replay


class ZmqOutlet:
    """The publisher's ZMQ sink: the PUB and replay sockets, and a pair per topic in ``by_topic`` carrying only that
    topic's batches (numbered as in the stream: the numbers between are other topics', and that pair's replay socket
    answers with its topic's batches from any number on); bound only while this process holds the turn to publish
    (``bound``); a batch sent while they are not is stored all the same, and replays serve it."""

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        codec: EventCodec,
        replays: Replays,
        buffer: int,
        by_topic: Mapping[str, tuple[str, str]] | None = None,
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._codec = codec
        self._replays = replays
        self._buffer = buffer
        self._by_topic = dict(by_topic or {})
        self._zmq: ZmqPublisher | None = None
        self._topics: dict[str, ZmqPublisher] = {}

    def send(self, batch: Batch) -> None:
        if self._zmq is not None:
            self._zmq.send(batch)
        if (own := self._topics.get(batch.topic)) is not None:
            own.send(batch)

    @contextlib.asynccontextmanager
    async def bound(self) -> AsyncIterator[None]:
        """The sockets bound (zmq.ZMQError if an address is taken), closed on exit."""
        async with contextlib.AsyncExitStack() as stack:
            zmq = await stack.enter_async_context(self._pair(self._endpoint, self._replay_endpoint, self._replays))
            topics = {
                topic: await stack.enter_async_context(self._pair(pub, replay, only_topic(self._replays, topic)))
                for topic, (pub, replay) in self._by_topic.items()
            }
            self._zmq, self._topics = zmq, topics
            try:
                yield
            finally:
                self._zmq, self._topics = None, {}

    @contextlib.asynccontextmanager
    async def _pair(self, endpoint: str, replay_endpoint: str | None, replays: Replays) -> AsyncIterator[ZmqPublisher]:
        from app.events.zmq_outlet import ZmqPublisher  # pyzmq only where events go out on ZMQ

        zmq = ZmqPublisher(
            endpoint=endpoint, replay_endpoint=replay_endpoint, codec=self._codec, replays=replays, buffer=self._buffer
        )
        zmq.start()
        log.info("kv events: pub=%s replay=%s", zmq.endpoint, zmq.replay_endpoint)
        try:
            yield zmq
        finally:
            await zmq.close()


@contextlib.asynccontextmanager
async def open_events(
    settings: Settings, *, parts: EventParts, index: Index, coordinator: Coordinator | None
) -> AsyncIterator[Events]:
    """The feed and this process's candidacy to publish (started); stopped in reverse, after a last round."""
    cfg = settings
    codec = None
    if cfg.events_endpoint:
        codec = EventCodec(
            WireFormat(
                medium=cfg.events_medium or None,
                locality=cfg.events_locality or None,
                ownership=cfg.events_ownership or None,
                int_hashes=cfg.events_int_hashes,
                encoding=cfg.events_encoding,
            )
        )
    feed = EventFeed(index=index, codec=codec, poll_s=cfg.events_poll_s)
    topics = Topics(cfg.events_topic, name=cfg.events_pool_name) if codec is not None else None
    outlet = None
    if codec is not None and topics is not None and cfg.events_endpoint:
        outlet = ZmqOutlet(
            endpoint=cfg.events_endpoint,
            replay_endpoint=cfg.events_replay_endpoint or None,
            codec=codec,
            replays=feed.replay,
            buffer=cfg.events_buffer,
            by_topic={
                topics.render(namespace="", model=model): pair for model, pair in cfg.events_model_endpoints.items()
            },
        )
    publisher = Publisher(
        index=index,
        codec=codec,
        topics=topics,
        models=parts.models,
        sinks=[outlet] if outlet is not None else [],
        keep=cfg.events_buffer,
        hold_s=cfg.events_hold_s,
        published=feed.published,
    )
    role = PublisherRole(
        publisher=publisher,
        index=index,
        coordinator=coordinator,
        sockets=outlet.bound if outlet is not None else None,
        wake=parts.wake,
        poll_s=cfg.events_poll_s,
    )
    role.start()
    try:
        yield Events(writer=parts.writer, feed=feed, role=role)
    finally:
        feed.end_streams()
        await parts.writer.close()
        await role.close()
