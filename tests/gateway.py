"""The gateway process the tests start (loopback/gateway.py, shared with the benchmarks), and what the tests read
from it."""

from __future__ import annotations

import time
from typing import Any

import httpx

from loopback.gateway import REPO as REPO
from loopback.gateway import Gateway as Gateway
from loopback.gateway import LoopbackProcess as LoopbackProcess
from loopback.gateway import free_port as free_port


def settled_stats(c: httpx.Client, *, timeout_s: float = 20.0) -> dict[str, Any]:
    """/v1/stats once background eviction has finished: usage is under the high mark and no round is in flight
    (a round goes on to the low mark, batch by batch, after usage passes the high one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats: dict[str, Any] = c.get("/v1/stats").json()
        bound = stats["max_bytes"]
        under = bound is None or stats["usage_bytes"] <= bound * stats["high_watermark"]
        if (under and not stats["evicting"]) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)
