"""NVIDIA Dynamo's KV indexer (ai-dynamo-runtime 1.6.x, ``python -m dynamo.indexer``) indexes the gateway's KV events
with the project's default event settings: registered with the gateway's PUB and replay addresses and the engine's
block size, its longest-prefix answer for every prompt equals ``POST /v1/lookup``'s, for two models on one gateway,
after stores made before it subscribed (it asks the replay socket from 0), stores, a TP=2 writer's parts, overwrites,
deletions, eviction and a purge.

Dynamo files everything an address carries under the model registered with it: with the default addresses each
model's prompts are compared under their own model; with a pair of addresses per model
(``KVGATE_EVENTS_MODEL_ENDPOINTS``) each prompt is also compared under the other model (where the lookup finds
nothing)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from contract.wire import format_block_meta
from tests.conftest import agnostic_fields
from tests.events.dynamo import DynamoIndexer, dynamo_python
from tests.events.helpers import events_gateway
from tests.events.router import Prompt
from tests.events.test_router_eye import BLOCK, BODY, MODELS, Engine, prompt
from tests.gateway import free_port, settled_stats

pytestmark = pytest.mark.dynamo
INSTANCE = {model: i + 1 for i, model in enumerate(MODELS)}
"""Dynamo's instance id of the gateway, for each model (one registration per model)."""


@dataclass
class Routed:
    """What Engine records: the prompts served."""

    routed: list[Prompt] = field(default_factory=list)


@pytest.mark.parametrize("addresses", ["shared", "per model"])
def test_dynamo_indexer_matches_lookup_with_default_settings(addresses: str, tmp_path: Path) -> None:
    python = dynamo_python()
    rnd = random.Random(11)
    env = {  # a capacity bound, for evictions; every KVGATE_EVENTS_* setting but the addresses at its default
        "KVGATE_MAX_BYTES": str(60 * BODY),
        "KVGATE_HIGH_WATERMARK": "0.9",
        "KVGATE_LOW_WATERMARK": "0.7",
        "KVGATE_EVICTION_INTERVAL_S": "0.2",
        "KVGATE_META_CACHE_TTL_S": "0",
    }
    own = {m: (f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for m in MODELS}
    if addresses == "per model":
        env["KVGATE_EVENTS_MODEL_ENDPOINTS"] = json.dumps(own)
    gw = events_gateway(tmp_path / "data", env=env).start()
    if addresses == "shared":
        own = dict.fromkeys(MODELS, (gw.pub, gw.replay))  # type: ignore[attr-defined]
    dynamo: DynamoIndexer | None = None
    routed = Routed()
    engines: list[Engine] = []
    systems = {m: [[rnd.randrange(50_000) for _ in range(BLOCK)] for _ in range(3)] for m in MODELS}

    def new_prompt(model: str) -> Prompt:
        user = [[rnd.randrange(50_000) for _ in range(BLOCK)] for _ in range(rnd.randint(1, 5))]
        return prompt(model, systems[model][: rnd.randint(0, 3)] + user)

    def serve_some(n: int, models: tuple[str, ...] = tuple(MODELS)) -> None:
        for _ in range(n):
            for engine in engines:
                engine.serve(new_prompt(rnd.choice(models)))

    def probes() -> list[Prompt]:
        """Every prompt served, and a continuation of some: what a router is asked to route; with an address per
        model, each under the other model too."""
        out = list(routed.routed)
        for p in rnd.sample(routed.routed, min(6, len(routed.routed))):
            out.append(prompt(p.model, [*p.blocks[: rnd.randint(1, len(p.blocks))], [7] * BLOCK]))
        if addresses == "per model":
            out += [prompt(m, p.blocks) for p in list(out) for m in MODELS if m != p.model]
        return out

    def checkpoint(name: str, *, timeout_s: float = 60.0) -> int:
        """Dynamo's answer equals the lookup's for every probe, once it has read what committed (it is told nothing
        else: it reads the stream); the number of probes compared."""
        assert dynamo is not None
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            settled_stats(http)  # background eviction over: nothing more changes meanwhile
            wanted = probes()
            truth = {}
            for p in wanted:
                resp = http.post("/v1/lookup", json={"keys": p.keys()})
                assert resp.status_code == 200, resp.text
                truth[id(p)] = resp.json()["prefix"]
        deadline = time.monotonic() + timeout_s
        while True:
            wrong = []
            for p in wanted:
                tokens = [t for b in p.blocks for t in b]
                theirs = dynamo.matched_tokens(model=p.model, token_ids=tokens, instance_id=INSTANCE[p.model])
                if theirs != truth[id(p)] * BLOCK:
                    wrong.append(f"{p.model} {len(p.blocks)} blocks: dynamo {theirs / BLOCK}, lookup {truth[id(p)]}")
            if not wrong:
                return len(wanted)
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{name}: {len(wrong)} of {len(wanted)} prompts differ: {wrong[:8]}\n{dynamo.log()[-4000:]}"
                )
            time.sleep(0.5)

    try:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            for model, ns in MODELS.items():
                assert http.put(f"/v1/namespaces/{ns}/config", json=agnostic_fields(model)).status_code in (200, 201)
        engines += [Engine("e1", gw.url, routed), Engine("e2", gw.url, routed)]  # type: ignore[arg-type]

        serve_some(2)  # before Dynamo subscribes: it reads these from the replay socket
        dynamo = DynamoIndexer(python, log_path=tmp_path / "dynamo.log")
        for model in MODELS:  # as an engine of each model, with the engine's block size
            dynamo.register(
                instance_id=INSTANCE[model],
                endpoint=own[model][0],
                replay_endpoint=own[model][1],
                model=model,
                block_size=BLOCK,
            )
        serve_some(2)
        checkpoint("stored")

        tp2 = new_prompt("test-org/model-a")  # a TP=2 writer: each rank PUTs its half of every block
        client = engines[0].client
        for i, key in enumerate(tp2.keys()):
            meta = format_block_meta(parent=tp2.hashes[i - 1] if i else None, tokens=tp2.blocks[i])
            body = engines[0].body(tp2.hashes[i])

            async def both_ranks(key: str = key, body: bytes = body, meta: str = meta) -> None:
                half = len(body) // 2
                await asyncio.gather(
                    client.put(key, body[:half], content_range=(0, half, len(body)), meta=meta),
                    client.put(key, body[half:], content_range=(half, len(body), len(body)), meta=meta),
                )

            client.run(both_ranks())
        routed.routed.append(tp2)
        checkpoint("a TP=2 writer's parts")

        for p in rnd.sample(routed.routed, 3):  # other bytes under the same keys
            engines[1].overwrite(p, rnd.randrange(len(p.blocks)))
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            for p in rnd.sample(routed.routed, 4):
                assert http.delete(f"/v1/blocks/{p.keys()[rnd.randrange(len(p.keys()))]}").status_code in (204, 404)
        checkpoint("overwritten and deleted")

        serve_some(6)  # past the capacity bound
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert settled_stats(http)["evictions"] > 0
        checkpoint("evicted")

        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert http.delete(f"/v1/namespaces/{MODELS['test-org/model-b']}").status_code == 200
        serve_some(1, models=("test-org/model-a",))
        compared = checkpoint("purged")
        assert compared >= 20
    finally:
        for engine in engines:
            engine.close()
        if dynamo is not None:
            dynamo.stop()
        gw.stop()


def test_dynamo_indexes_tier_chunks_registered_with_the_chunks_size(tmp_path: Path) -> None:
    """vLLM's OffloadingConnector tier with two blocks per chunk stores one key per chunk, whose event carries the
    chunk's tokens: Dynamo registered with the chunk's size (what docs/events.md says to register) indexes them."""
    python = dynamo_python()
    chunk = 2 * BLOCK
    model = "test-org/model-a"
    rnd = random.Random(5)
    gw = events_gateway(tmp_path / "data").start()
    dynamo = DynamoIndexer(python, log_path=tmp_path / "dynamo.log")
    try:
        dynamo.register(instance_id=1, endpoint=gw.pub, replay_endpoint=gw.replay, model=model, block_size=chunk)  # type: ignore[attr-defined]
        stored = [prompt(model, [[rnd.randrange(50_000) for _ in range(chunk)] for _ in range(3)]) for _ in range(3)]
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert http.put(f"/v1/namespaces/{MODELS[model]}/config", json=agnostic_fields(model)).status_code == 201
            for p in stored:
                for i, key in enumerate(p.keys()):
                    meta = format_block_meta(parent=p.hashes[i - 1] if i else None, tokens=p.blocks[i])
                    resp = http.put(f"/v1/blocks/{key}", content=b"c" * BODY, headers={"X-KVGate-Block-Meta": meta})
                    assert resp.status_code == 201, resp.text
            assert http.delete(f"/v1/blocks/{stored[0].keys()[1]}").status_code == 204
            want = [http.post("/v1/lookup", json={"keys": p.keys()}).json()["prefix"] * chunk for p in stored]
        assert want == [chunk, 3 * chunk, 3 * chunk]
        deadline = time.monotonic() + 60
        while True:
            got = [
                dynamo.matched_tokens(model=model, token_ids=[t for b in p.blocks for t in b], instance_id=1)
                for p in stored
            ]
            if got == want:
                break
            assert time.monotonic() < deadline, f"dynamo {got}, lookup {want}\n{dynamo.log()[-3000:]}"
            time.sleep(0.5)
    finally:
        dynamo.stop()
        gw.stop()
