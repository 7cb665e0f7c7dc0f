"""A gateway process's events, assembled: the writer the core calls, the publisher candidacy, the feed of
``GET /v1/events``. ``kvgate gc`` and ``kvgate import`` need none of it: with events on, their index writes their
changes' rows, and a gateway's publisher sends them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.config import Settings
from app.core.coordination import Coordinator
from app.core.events import EventWriter
from app.core.events_feed import EventFeed
from app.core.events_publisher import Publisher, PublisherRole
from app.core.events_wire import EventCodec, ModelNames, Topics, WireFormat
from app.index import Index

if TYPE_CHECKING:
    from app.core.events_zmq import ZmqPublisher

log = logging.getLogger("kvgate.events")


@dataclass(frozen=True, slots=True)
class Events:
    writer: EventWriter
    feed: EventFeed
    role: PublisherRole


async def event_writer(settings: Settings, *, index: Index) -> EventWriter | None:
    """The writer, with the stream's state created if it has none (None: events off). Its first batch is numbered
    with the wall clock in microseconds: above any number a gateway gave out when numbers came from the clock."""
    if not settings.events_enabled:
        return None
    await index.event_init(first_seq=time.time_ns() // 1000)
    return EventWriter(index=index)


@contextlib.asynccontextmanager
async def open_events(
    settings: Settings, *, writer: EventWriter, index: Index, coordinator: Coordinator | None
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

    async def model_name(namespace: str) -> str | None:
        record = await index.get_namespace(namespace)
        name = record.fields.get("model_name") if record is not None else None
        return name if isinstance(name, str) else None

    models = ModelNames(model_name)
    publisher = Publisher(
        index=index,
        codec=codec,
        topics=Topics(cfg.events_topic, name=cfg.events_pool_name) if codec is not None else None,
        models=models,
        keep=cfg.events_buffer,
        hold_s=cfg.events_hold_s,
        published=feed.published,
    )
    open_zmq = None
    if codec is not None and cfg.events_endpoint:
        endpoint, replay_endpoint, zmq_codec = cfg.events_endpoint, cfg.events_replay_endpoint or None, codec

        def open_zmq() -> ZmqPublisher:
            from app.core.events_zmq import ZmqPublisher  # pyzmq only where events go out on ZMQ

            zmq = ZmqPublisher(
                endpoint=endpoint,
                replay_endpoint=replay_endpoint,
                codec=zmq_codec,
                replays=feed.replay,
                buffer=cfg.events_buffer,
            )
            zmq.start()
            publisher.sinks = [zmq]
            log.info("kv events: pub=%s replay=%s", zmq.endpoint, zmq.replay_endpoint)
            return zmq

    role = PublisherRole(
        publisher=publisher, index=index, coordinator=coordinator, open_zmq=open_zmq, poll_s=cfg.events_poll_s
    )
    writer.committed = role.wake
    writer.config_stored = models.learn
    role.start()
    try:
        yield Events(writer=writer, feed=feed, role=role)
    finally:
        feed.end_streams()
        await writer.close()
        await role.close()
