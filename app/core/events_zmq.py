"""KV events in vLLM's own wire format (vllm/distributed/kv_events.py, vLLM 0.33): a ZMQ PUB socket sending
``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)`` and a ROUTER replay socket: a subscriber's REQ socket
sends a start sequence number (8 bytes big-endian) and gets every batch still held from that number on, each as
``(topic, seq, payload)``, then the end marker ``(b"", -1 as 8 bytes, b"")``.

The structs below encode exactly as vLLM's (same names, fields, tags and options), so a subscriber decodes them
with ``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``. Block hashes take the form vLLM's events
carry by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``): the low 64 bits of the hash as an unsigned int;
with ``events_int_hashes`` off, the hash's bytes. Both sockets live on the event loop: a PUB send never blocks
(past its high-water mark ZMQ drops, as vLLM's publisher does), and replays are served by one task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from app.core.events import Batch, Event

log = logging.getLogger("kvgate.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events (tagged by class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


def wire_hash(hex_hash: str, *, as_int: bool) -> int | bytes:
    """A key's block hash (hex) in the form vLLM's events carry it."""
    raw = bytes.fromhex(hex_hash)
    return int.from_bytes(raw, "big") & ((1 << 64) - 1) if as_int else raw


def wire_event(event: Event, *, medium: str, as_int: bool) -> BlockStored | BlockRemoved:
    h = wire_hash(event.block_hash, as_int=as_int)
    if event.kind == "removed":
        return BlockRemoved(block_hashes=[h], medium=medium, group_idx=event.group)
    meta = event.meta
    tokens = list(meta.token_ids) if meta is not None else []
    parent = wire_hash(meta.parent, as_int=as_int) if meta is not None and meta.parent else None
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=len(tokens),
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=event.group,
    )


class ZmqPublisher:
    """A BatchSink: each batch encoded once, sent on the PUB socket and kept for replays."""

    def __init__(
        self,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str = "",
        medium: str = "kvgate",
        int_hashes: bool = True,
        buffer: int = 10_000,
        hwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sync = zmq.Context()
        """The PUB socket is a plain one: its sends never block and have no future to wait for."""
        self._topic = topic.encode()
        self._medium = medium
        self._int = int_hashes
        self._encoder = msgspec.msgpack.Encoder()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer)
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

    def encode(self, batch: Batch) -> bytes:
        events = [wire_event(e, medium=self._medium, as_int=self._int) for e in batch.events]
        return self._encoder.encode(KVEventBatch(ts=batch.ts, events=events))

    def send(self, batch: Batch) -> None:
        payload = self.encode(batch)
        seq = batch.seq.to_bytes(8, "big")
        self._ring.append((batch.seq, payload))
        with contextlib.suppress(zmq.Again):  # PUB drops past its high-water mark; replays fill the gap
            self._pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)

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
                for seq, payload in list(self._ring):
                    if seq >= first:
                        await sock.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                await sock.send_multipart((client, b"", b"", END_SEQ, b""))
            except zmq.ZMQError as exc:  # the subscriber went away: serve the next one
                log.warning("replay failed: %s", exc)

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
