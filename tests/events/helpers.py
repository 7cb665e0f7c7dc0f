"""A real gateway with KV events on (ZMQ on loopback ports), and readers of its SSE stream."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.gateway import Gateway, free_port


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
