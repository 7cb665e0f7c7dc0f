"""A real gateway with KV events on (ZMQ on loopback ports), and readers of its SSE stream."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from contract.keys import namespace_for
from tests.conftest import agnostic_fields, key_for
from tests.gateway import Gateway, free_port

JOIN_NS = namespace_for(agnostic_fields("kvgate-test/join"))
"""Where :func:`joined` PUTs its blocks (out of the way of a test's own namespace)."""


def events_gateway(data_dir: Path, *, env: Mapping[str, str] | None = None) -> Gateway:
    pub, rep = free_port(), free_port()
    gw = Gateway(
        data_dir,
        env={
            "KVGATE_EVENTS_ENABLED": "true",
            "KVGATE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
            "KVGATE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{rep}",
            **(env or {}),
        },
    )
    gw.pub = f"tcp://127.0.0.1:{pub}"  # type: ignore[attr-defined]
    gw.replay = f"tcp://127.0.0.1:{rep}"  # type: ignore[attr-defined]
    return gw


def sse(resp: httpx.Response) -> Iterator[tuple[str, dict[str, Any]]]:
    """(event, data) of each server-sent event of a streaming response; a heartbeat is ("heartbeat", {})."""
    event, data = "message", ""
    for line in resp.iter_lines():
        if line.startswith(":"):
            yield "heartbeat", {}
        elif not line:
            if data:
                yield event, json.loads(data)
            event, data = "message", ""
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]


def hello(url: str) -> dict[str, Any]:
    """The stream's first message: first_seq and next_seq."""
    with httpx.stream("GET", f"{url}/v1/events", timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        event, data = next(sse(resp))
        assert event == "hello"
        return data


def read_batches(url: str, *, since: int, events: int, namespace: str | None = None) -> list[dict[str, Any]]:
    """Batches from ``since`` until ``events`` events have come. The changes were acknowledged before this reads,
    so their batches are all in the ring and come at once: a heartbeat means no more are coming."""
    params: dict[str, Any] = {"since": since}
    if namespace is not None:
        params["namespace"] = namespace
    out: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{url}/v1/events", params=params, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for event, data in sse(resp):
            assert event in ("hello", "batch"), (event, data, f"{sum(len(b['events']) for b in out)} events")
            if event == "batch":
                out.append(data)
                if sum(len(b["events"]) for b in out) >= events:
                    return out
    raise AssertionError(f"stream ended after {out}")


class ZmqTap:
    """A ZMQ subscriber on a thread: every batch of the gateway's PUB socket as (topic, seq, decoded payload)."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self.batches: list[tuple[str, int, Any]] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.connect(endpoint)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, "")
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec

        while not self._stop.is_set():
            if self._sock.poll(50):
                topic, seq, payload = self._sock.recv_multipart()
                with self._lock:
                    self.batches.append((topic.decode(), int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))

    def events(self) -> list[tuple[int, dict[str, Any]]]:
        """(seq, event as a map) of every event received, in order."""
        with self._lock:
            return [(seq, e) for _t, seq, batch in self.batches for e in batch[1]]

    def wait(self, done: Any, *, timeout_s: float = 30.0) -> None:
        """Until ``done(self)`` is true (the changes were acknowledged before: their events are on their way)."""
        import time

        deadline = time.monotonic() + timeout_s
        while not done(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"the subscriber has {len(self.batches)} batches: {self.batches[-5:]}")
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


def h64(key: str) -> int:
    """The block hash of a key as the events carry it by default: the low 64 bits, as an int."""
    return int(key.rsplit("/", 1)[1].removesuffix(".bin")[-16:], 16)


def joined(url: str, tap: ZmqTap) -> int:
    """PUT blocks until the subscriber sees one (a SUB socket misses what is sent before it has joined); the next
    sequence number."""
    with httpx.Client(base_url=url, timeout=30) as http:
        for i in range(200):
            key = key_for(10_000 + i, namespace=JOIN_NS)
            assert http.put(f"/v1/blocks/{key}", content=b"w" * 64).status_code == 201
            try:
                tap.wait(lambda t: bool(t.batches), timeout_s=0.1)
                break
            except AssertionError:
                continue
    tap.wait(lambda t: t.batches[-1][1] == hello(url)["next_seq"] - 1)
    return hello(url)["next_seq"]
