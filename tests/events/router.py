"""A router's index of the shared tier, built from the gateway's KV events alone, as llm-d's KV-cache indexer builds
its own: ZMQ SUB on the pool's topics, the model from the topic (``kv@pool:<name>@<model>``), each block keyed by a
hash of its parent's key, the model and its token ids (the engine's block hash only links a block to its parent).

It keeps no assumption about how the gateway numbers batches beyond "each next one is one more": a number it did not
expect is a gap, filled from the replay socket when the gateway still holds the batches, and otherwise (batches no
longer held) by a resync: one ``POST /v1/lookup`` over the prompts it has routed, then the stream from there on.

With several gateway processes or replicas, one publishes at a time, on its own addresses: the router connects its SUB
socket to every PUB address and its replay DEALER (``ZMQ_IMMEDIATE``: only to peers that listen) to every replay
address, and reads one stream.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq

from contract.keys import block_path

END = (-1).to_bytes(8, "big", signed=True)
ROOT = b"root"


def request_key(parent: bytes, model: str, tokens: Sequence[int]) -> bytes:
    """The router's own key of a block: its parent's key, the model and its tokens (never the engine's hash)."""
    return hashlib.sha256(parent + model.encode() + b"".join(t.to_bytes(4, "big") for t in tokens)).digest()


@dataclass
class Prompt:
    """A prompt the router routed: its model, namespace, full blocks' token ids and engine hashes (for a resync)."""

    model: str
    namespace: str
    blocks: list[list[int]]
    hashes: list[bytes]

    def keys(self) -> list[str]:
        return [block_path(namespace=self.namespace, rank=0, block_hash=h, group=0) for h in self.hashes]


@dataclass
class Router:
    pub: str | list[str]
    replay: str | list[str]
    url: str
    topic_prefix: str = "kv@pool:kvgate@"
    expected: int | None = None
    chain: dict[tuple[str, int], bytes] = field(default_factory=dict)
    """(model, engine hash as events carry it) -> the block's key (kept after a removal: it is knowledge)."""
    present: dict[str, set[bytes]] = field(default_factory=dict)
    parked: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    history: dict[tuple[str, int], list[tuple[int, str]]] = field(default_factory=dict)
    """(model, block hash) -> the (seq, event type) of every event that named it, in the order applied: what a
    failed comparison prints for the block it disagrees on."""
    """Stores that came before their parent's, waiting for it (llm-d drops them)."""
    routed: list[Prompt] = field(default_factory=list)
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "batches": 0,
            "events": 0,
            "replayed": 0,
            "resyncs": 0,
            "orphans": 0,
            "gaps": 0,
            "twice": 0,
        }
    )
    """``twice``: batches that came live more than once (two publishers would send them)."""
    live: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._ctx = zmq.Context()
        self._sub: zmq.Socket[bytes] | None = None
        self.connect()

    # -- the stream ------------------------------------------------------------------------------------------------

    def connect(self) -> None:
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)
        for endpoint in [self.pub] if isinstance(self.pub, str) else self.pub:
            self._sub.connect(endpoint)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, self.topic_prefix)

    def disconnect(self) -> None:
        """Stop listening (what it misses meanwhile is a gap to recover)."""
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    def close(self) -> None:
        self.disconnect()
        self._ctx.term()

    def poll(self, timeout_ms: int) -> bool:
        """Take one batch of the live stream; False if none came within ``timeout_ms``."""
        if self._sub is None or not self._sub.poll(timeout_ms):
            return False
        topic, raw, payload = self._sub.recv_multipart()
        seq = int.from_bytes(raw, "big")
        if seq in self.live:
            self.counts["twice"] += 1
        self.live.add(seq)
        self._take(topic.decode(), seq, payload)
        return True

    def _take(self, topic: str, seq: int, payload: bytes) -> None:
        if self.expected is not None and seq < self.expected:
            return  # already applied (from a replay)
        if self.expected is not None and seq > self.expected:
            self.counts["gaps"] += 1
            self.recover()
            if seq < self.expected:
                return
        self._apply(topic, payload, seq)
        self.expected = seq + 1

    def recover(self) -> None:
        """Fill the gap from ``expected`` on: from the replay socket if it still holds that batch, else a resync."""
        start = self.expected if self.expected is not None else 0
        batches = self._replay(start)
        if not batches or batches[0][1] != start:
            self.resync()  # not held (or never was): what changed meanwhile comes from the lookup
        else:
            self.counts["replayed"] += len(batches)
        for topic, seq, payload in batches:
            self._apply(topic, payload, seq)
            self.expected = seq + 1

    def _replay(self, start: int) -> list[tuple[str, int, bytes]]:
        sock = self._ctx.socket(zmq.DEALER)  # a fresh one: an answer from a gateway that went away is never read
        sock.setsockopt(zmq.IMMEDIATE, 1)  # a request goes only to a peer that listens: the publisher
        for endpoint in [self.replay] if isinstance(self.replay, str) else self.replay:
            sock.connect(endpoint)
        out: list[tuple[str, int, bytes]] = []
        try:
            if not sock.poll(5000, zmq.POLLOUT):
                return []  # no publisher listens: resync
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(5000):
                _empty, topic, seq, payload = sock.recv_multipart()
                if seq == END:
                    return out
                out.append((topic.decode(), int.from_bytes(seq, "big"), payload))
            return []  # no end marker: the gateway is not answering; resync
        finally:
            sock.close(linger=0)

    def catch_up(self, next_seq: int) -> None:
        """Until every batch numbered below ``next_seq`` (the gateway's ``hello``) is applied."""
        for _ in range(100_000):
            if self.expected is not None and self.expected >= next_seq:
                return
            if not self.poll(200):
                if self.expected is None:
                    self.resync()
                    self.expected = next_seq
                else:
                    self.recover()
                    if self.expected < next_seq:  # nothing held from there on (a restart): the lookup is the truth
                        self.resync()
                        self.expected = next_seq
        raise AssertionError(f"the router is at {self.expected}, the gateway at {next_seq}")

    # -- the index -------------------------------------------------------------------------------------------------

    def _apply(self, topic: str, payload: bytes, seq: int) -> None:
        model = topic.split("@", 2)[2]
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        self.counts["batches"] += 1
        for event in events:
            self.counts["events"] += 1
            for h in event["block_hashes"]:
                self.history.setdefault((model, h), []).append((seq, event["type"]))
            if event["type"] == "BlockStored":
                self._stored(model, event)
            elif event["type"] == "BlockRemoved":
                for h in event["block_hashes"]:
                    rk = self.chain.get((model, h))
                    if rk is not None:
                        self.present.setdefault(model, set()).discard(rk)

    def _stored(self, model: str, event: dict[str, Any]) -> None:
        hashes, tokens, size = event["block_hashes"], event["token_ids"], event["block_size"]
        if not tokens or size * len(hashes) != len(tokens):
            return  # no token ids: nothing a router can key
        parent = event["parent_block_hash"]
        if parent is None:
            parent_key: bytes | None = ROOT
        else:
            parent_key = self.chain.get((model, parent))
        if parent_key is None:
            self.counts["orphans"] += 1
            self.parked.setdefault((model, parent), []).append(event)
            return
        for i, h in enumerate(hashes):
            parent_key = request_key(parent_key, model, tokens[i * size : (i + 1) * size])
            self.chain[(model, h)] = parent_key
            self.present.setdefault(model, set()).add(parent_key)
            for child in self.parked.pop((model, h), ()):
                self._stored(model, child)

    def resync(self) -> None:
        """The index of the prompts it routed, from one lookup each: the gateway's state now."""
        self.counts["resyncs"] += 1
        self.present = {}
        with httpx.Client(base_url=self.url, timeout=30) as http:
            for prompt in self.routed:
                resp = http.post("/v1/lookup", json={"keys": prompt.keys()})
                assert resp.status_code == 200, resp.text
                rk = ROOT
                for tokens, h, slot in zip(prompt.blocks, prompt.hashes, resp.json()["blocks"], strict=True):
                    rk = request_key(rk, prompt.model, tokens)
                    self.chain[(prompt.model, int.from_bytes(h[-8:], "big"))] = rk
                    if slot["present"]:
                        self.present.setdefault(prompt.model, set()).add(rk)

    def longest_prefix(self, model: str, blocks: Sequence[Sequence[int]]) -> int:
        """Leading blocks of a prompt held in the shared tier, by this index."""
        held = self.present.get(model, set())
        rk, n = ROOT, 0
        for tokens in blocks:
            rk = request_key(rk, model, tokens)
            if rk not in held:
                break
            n += 1
        return n
