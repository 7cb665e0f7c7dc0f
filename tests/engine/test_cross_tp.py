"""Cross-TP with a real engine: blocks stored at TP=2 (two CPU worker processes, each PUTting its head's byte range
of the canonical object) load at TP=1, and blocks stored at TP=1 load at TP=2 (each rank GETs its range).

Three engine processes: TP=2 stores P; TP=1 loads P and stores Q; TP=2 loads Q.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.engine.conftest import Engine, words
from tests.engine.test_engine import full_blocks, same_output
from tests.gateway import Gateway

# the module fixture makes several engine runs (about a minute each here, several under load): not 300 s in all
pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

P = words(78, seed=6000)
Q = words(78, seed=7000)


def stored_blocks(gw: Gateway) -> int:
    return sum(int(n["blocks"]) for n in httpx.get(f"{gw.url}/v1/namespaces", timeout=10).json()["namespaces"])


def test_tp2_to_tp1_and_back(engine: Engine, engine_gateway: Gateway) -> None:
    gw = engine_gateway
    start = stored_blocks(gw)
    # P has ~150 tokens: 4 full blocks, assembled from the two ranks' parts.
    a2 = engine.run(prompts=[P], url=gw.url, tp=2, wait_blocks=[start + 4])["results"][0]
    assert full_blocks(a2) == 4
    b1 = engine.run(prompts=[P, Q], url=gw.url, wait_blocks=[0, start + 4 + 4])["results"]
    assert b1[0]["external_hits"] == 4 * 32  # every full block of P, written at TP=2, is a hit at TP=1
    assert same_output(b1[0], a2)
    b2: dict[str, Any] = engine.run(prompts=[Q], url=gw.url, tp=2)["results"][0]
    assert b2["external_hits"] == full_blocks(b1[1]) * 32  # written at TP=1, a hit at TP=2
    assert same_output(b2, b1[1])
