"""A gateway process's events, assembled: the writer the core calls, the publisher candidacy, the feed of
``GET /v1/events``. ``kvgate gc`` and ``kvgate import`` need none of it: with events on, their index writes their
changes' rows, and a gateway's publisher sends them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.config import Settings
from app.core.coordination import Coordinator
from app.core.events import Batch, EventWriter
from app.core.events_feed import EventFeed
from app.core.events_publisher import Publisher, PublisherRole
from app.core.events_wire import EventCodec, ModelNames, Topics, WireFormat
from app.index import Index

if TYPE_CHECKING:
    from app.core.events_zmq import Replays, ZmqPublisher

log = logging.getLogger("kvgate.events")


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
            return await index.event_config_model(namespace)
        name = record.fields.get("model_name")
        return name if isinstance(name, str) else None

    return model_name


async def event_parts(settings: Settings, *, index: Index) -> EventParts | None:
    """The writer and what it tells, with the stream's state created if it has none (None: events off). Its first
    batch is numbered with the wall clock in microseconds: above any number a gateway gave out when numbers came
    from the clock."""
    if not settings.events_enabled:
        return None
    await index.event_init(first_seq=time.time_ns() // 1000)

    models = ModelNames(model_lookup(index))
    wake = asyncio.Event()
    writer = EventWriter(index=index, committed=wake.set, config_stored=models.learn)
    return EventParts(writer=writer, models=models, wake=wake)


class ZmqOutlet:
    """The publisher's ZMQ sink: the PUB and replay sockets, bound only while this process holds the turn to
    publish (``bound``); a batch sent while they are not is stored all the same, and replays serve it."""

    def __init__(
        self, *, endpoint: str, replay_endpoint: str | None, codec: EventCodec, replays: Replays, buffer: int
    ) -> None:
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._codec = codec
        self._replays = replays
        self._buffer = buffer
        self._zmq: ZmqPublisher | None = None

    def send(self, batch: Batch) -> None:
        if self._zmq is not None:
            self._zmq.send(batch)

    @contextlib.asynccontextmanager
    async def bound(self) -> AsyncIterator[None]:
        """The sockets bound (zmq.ZMQError if an address is taken), closed on exit."""
        from app.core.events_zmq import ZmqPublisher  # pyzmq only where events go out on ZMQ

        zmq = ZmqPublisher(
            endpoint=self._endpoint,
            replay_endpoint=self._replay_endpoint,
            codec=self._codec,
            replays=self._replays,
            buffer=self._buffer,
        )
        zmq.start()
        self._zmq = zmq
        log.info("kv events: pub=%s replay=%s", zmq.endpoint, zmq.replay_endpoint)
        try:
            yield
        finally:
            self._zmq = None
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
    outlet = None
    if codec is not None and cfg.events_endpoint:
        outlet = ZmqOutlet(
            endpoint=cfg.events_endpoint,
            replay_endpoint=cfg.events_replay_endpoint or None,
            codec=codec,
            replays=feed.replay,
            buffer=cfg.events_buffer,
        )
    publisher = Publisher(
        index=index,
        codec=codec,
        topics=Topics(cfg.events_topic, name=cfg.events_pool_name) if codec is not None else None,
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
