"""A real gateway with KV events on (ZMQ on loopback ports), and readers of its SSE stream."""

from __future__ import annotations

import contextlib
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


def events_env(pub: int, rep: int) -> dict[str, str]:
    return {
        "KVGATE_EVENTS_ENABLED": "true",
        "KVGATE_EVENTS_ENDPOINT": f"tcp://127.0.0.1:{pub}",
        "KVGATE_EVENTS_REPLAY_ENDPOINT": f"tcp://127.0.0.1:{rep}",
    }


def events_gateway(
    data_dir: Path, *, env: Mapping[str, str] | None = None, ports: tuple[int, int] | None = None
) -> Gateway:
    """A gateway with events on; ``ports``: its PUB and replay ports (several processes of one deployment share
    them: the one that publishes binds them)."""
    pub, rep = ports or (free_port(), free_port())
    gw = Gateway(data_dir, env={**events_env(pub, rep), **(env or {})})
    gw.pub = f"tcp://127.0.0.1:{pub}"  # type: ignore[attr-defined]
    gw.replay = f"tcp://127.0.0.1:{rep}"  # type: ignore[attr-defined]
    gw.ports = (pub, rep)  # type: ignore[attr-defined]
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


def listening_pid(port: int, pids: list[int]) -> int | None:
    """Which of ``pids`` listens on the loopback TCP ``port`` (Linux /proc), if any: the events publisher binds the
    ZMQ sockets, the processes standing by do not."""
    import os
    from pathlib import Path

    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # LISTEN
                    inodes.add(fields[9])
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:[") and target[8:-1] in inodes:
                        return pid
    return None


def wait_for_publisher(port: int, pids: list[int], *, timeout_s: float = 60.0) -> int:
    """The pid of ``pids`` that publishes (listens on ``port``), once one does."""
    import time

    deadline = time.monotonic() + timeout_s
    while (pid := listening_pid(port, pids)) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"none of {pids} listens on {port}")
        time.sleep(0.1)
    return pid


def run_tool(*args: str, data_dir: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """``kvgate ARGS`` (``gc --json``, ``import DIR``) over ``data_dir`` with ``env`` (the gateway's settings): the JSON
    report it prints."""
    import os
    import subprocess
    import sys

    from tests.gateway import REPO

    full = {**os.environ, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(data_dir), **env}
    out = subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, env=full, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report: dict[str, Any] = json.loads(out.stdout)
    return report


def run_gc(data_dir: Path, *, env: Mapping[str, str]) -> dict[str, Any]:
    return run_tool("gc", "--json", data_dir=data_dir, env=env)
