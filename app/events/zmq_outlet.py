"""KV events on ZMQ, as vLLM publishes them (vllm/distributed/kv_events.py, vLLM 0.33): a PUB socket sending
``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)`` and a ROUTER replay socket: a subscriber's REQ or
DEALER socket sends a start sequence number (8 bytes big-endian) and gets every batch still kept from that number
on, each as ``(topic, seq, payload)``, then the end marker ``(b"", -1 as 8 bytes, b"")``.

The payload is the batch of events encoded one by one (app/events/wire.py); each batch has its topic
(``kv@pool:{name}@{model}`` by default: one model's events). Only the publisher (app/events/publisher.py)
binds them. Replays read the stored batches (app/events/feed.py), so they reach back past a restart or a
failover. Both sockets live on the event loop: a PUB send never blocks (past its high-water mark ZMQ drops, as
vLLM's publisher does), and replays are served by one task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio

from app.events.model import Batch
from app.events.wire import EventCodec

log = logging.getLogger("kvgate.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


Replays = Callable[[int], AsyncIterator[Batch]]
"""The batches kept from a number on (EventFeed.replay)."""


async def _none(first: int) -> AsyncIterator[Batch]:
    none: tuple[Batch, ...] = ()
    for batch in none:
        yield batch


class ZmqPublisher:
    """A BatchSink: each batch assembled from its encoded events and sent on the PUB socket; replays from
    ``replays`` (the ``buffer`` batches kept)."""

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        codec: EventCodec,
        replays: Replays = _none,
        buffer: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sync = zmq.Context()
        """The PUB socket is a plain one: its sends never block and have no future to wait for."""
        self.codec = codec
        self._replays = replays
        self._pub: zmq.Socket[bytes] = self._sync.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer + 1))  # a full replay and its end marker fit
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays(), name="kvgate-events-replay")

    def send(self, batch: Batch) -> None:
        payload = self.codec.batch(ts=batch.ts, events=[e.wire for e in batch.events])
        topic = batch.topic.encode()
        with contextlib.suppress(zmq.Again):  # PUB drops past its high-water mark; replays fill the gap
            self._pub.send_multipart((topic, batch.seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replays(self) -> None:
        sock = self._replay
        if sock is None:
            return
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("invalid replay request (%d frames)", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            try:
                async for batch in self._replays(first):
                    payload = self.codec.batch(ts=batch.ts, events=[e.wire for e in batch.events])
                    await sock.send_multipart(
                        (client, b"", batch.topic.encode(), batch.seq.to_bytes(8, "big"), payload)
                    )
                await sock.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # the subscriber went away: serve the next one
                log.warning("replay failed: %s", exc)
            except Exception as exc:  # the index is out: no end marker, the subscriber resyncs
                log.warning("replay failed: %s: %s", type(exc).__name__, exc)

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
        self._sync.term()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._close_sockets()
