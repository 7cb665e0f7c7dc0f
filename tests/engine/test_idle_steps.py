"""A real engine in one process (VLLM_ENABLE_V1_MULTIPROCESSING=0, as inference embedded in a training or evaluation
loop runs it): while a request waits for its KV from kvgate and nothing else is scheduled, the engine's steps wait
for the load instead of spinning; a step that has work is never held back by a load in flight.

One process stores the prompt H; a fresh one runs M (a miss) and, once M decodes, H (a hit), with the worker's
loads held (its client's event loop blocked, tests/engine/probes.py) until M has finished. The waits' bounds are
raised to 10 minutes, so a step can only come back early from a wait because the load completed: the step counts do
not depend on this machine's speed. Outputs equal the run without kvgate (tokens and logprobs).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.conftest import BLOCK, Engine, words
from tests.engine.test_engine import full_blocks, same_output
from tests.gateway import Gateway

pytestmark = [pytest.mark.engine, pytest.mark.timeout(2400)]

H = words(330, seed=8000)  # ~640 tokens: 20 full blocks to load
M = words(60, seed=8100)
TOKENS = 48  # M decodes this long: H's lookup answers and its load starts while M runs
BOUND_MS = 600_000


def test_idle_steps_wait_for_loads_and_steps_with_work_never_do(engine: Engine, engine_gateway: Gateway) -> None:
    gw = engine_gateway
    base = engine.run(prompts=[H, M], max_tokens=TOKENS)["results"]
    blocks = full_blocks(base[0])
    engine.run(prompts=[H], url=gw.url, max_tokens=TOKENS, wait_blocks=[blocks])
    extra = {"lookup_wait_ms": BOUND_MS, "load_wait_ms": BOUND_MS}
    run = engine.run(prompts=[], url=gw.url, max_tokens=TOKENS, warmup=True, extra=extra, gated={"hit": H, "miss": M})
    g: dict[str, Any] = run["gated"]
    print(f"gated run: {g['steps']}, {g['load_waits']} idle waits")
    assert g["load_started_while_miss_ran"], "H's load did not start while M ran: the scenario did not happen"
    # Every step of M while H's load was held had work: none waited for the load (which could not complete).
    assert g["miss_finished_while_loads_held"], "a step with work waited for a load in flight"
    # Then nothing but H: one step waits for its load and reports it, the next computes H's last tokens and its
    # first token; an engine whose idle steps return at once takes a step per pass of its loop until the load is in
    # (dozens to thousands here, as the machine goes).
    assert g["steps"]["release_to_hit_token"] <= 3, g["steps"]
    assert g["load_waits"] >= 1
    hit, miss = g["outputs"]["hit"], g["outputs"]["miss"]
    assert same_output(hit, base[0]) and same_output(miss, base[1])
    assert len(hit["prompt_token_ids"]) // BLOCK == blocks
