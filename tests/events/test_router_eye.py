"""The router's-eye test: an index of the shared tier built from the events alone agrees with ``POST /v1/lookup``.

Two engines (the connector's own HTTP client, storing what a prompt's lookup says is missing, each block with its
meta, a prompt's blocks at once) serve prompts of two models, each through its own gateway process of one deployment
with a capacity bound: two processes on one data directory (SQLite), or two replicas over PostgreSQL and SeaweedFS.
Blocks are stored, overwritten, deleted, evicted, dropped by ``kvgate gc`` (one machine) and a model purged; the
router stops listening for a while (a gap it fills from the replay socket) and the publishing gateway restarts in the
middle (the other takes over, and the numbers go on: the router never needs a lookup to resync). At every checkpoint
the router's longest-prefix answer for random prompts, from its index keyed by token ids as llm-d's is, equals the
gateway's, and no batch came twice.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from connector.http.client import BlockClient, ClientConfig
from contract.keys import namespace_for
from contract.wire import format_block_meta
from tests.conftest import agnostic_fields
from tests.events.helpers import events_gateway, hello, run_gc
from tests.events.router import Prompt, Router
from tests.gateway import Gateway, free_port, settled_stats
from tests.services import unique_bucket

BLOCK = 16
BODY = 2048
MODELS = {m: namespace_for(agnostic_fields(m)) for m in ("test-org/model-a", "test-org/model-b")}


def chain(blocks: list[list[int]]) -> list[bytes]:
    """Engine block hashes: each the sha256 of its parent's and its tokens (vLLM's scheme, simplified)."""
    out, h = [], b"\0" * 32
    for tokens in blocks:
        h = hashlib.sha256(h + b"".join(t.to_bytes(4, "big") for t in tokens)).digest()
        out.append(h)
    return out


def prompt(model: str, blocks: list[list[int]]) -> Prompt:
    return Prompt(model=model, namespace=MODELS[model], blocks=blocks, hashes=chain(blocks))


class Engine:
    """Stores a prompt's blocks as the connector does: one lookup, then the missing blocks, concurrently, with meta."""

    def __init__(self, name: str, url: str, router: Router) -> None:
        self.name, self.router = name, router
        self.client = BlockClient(ClientConfig(base_url=url, max_connections=8, retries=4))
        self.version = 0

    def serve(self, p: Prompt) -> None:
        self.router.routed.append(p)  # the router routed it here
        keys = p.keys()
        prefix, _ = self.client.run(self.client.lookup(keys))
        calls = [
            self.client.put(
                keys[i],
                self.body(p.hashes[i]),
                meta=format_block_meta(parent=p.hashes[i - 1] if i else None, tokens=p.blocks[i]),
            )
            for i in range(prefix, len(keys))
        ]

        async def all_at_once() -> None:
            await asyncio.gather(*calls)

        self.client.run(all_at_once(), timeout_s=120)

    def overwrite(self, p: Prompt, i: int) -> None:
        """Store block ``i`` again with other bytes (a new version: a new BlockStored)."""
        self.version += 1
        meta = format_block_meta(parent=p.hashes[i - 1] if i else None, tokens=p.blocks[i])
        assert self.client.run(self.client.put(p.keys()[i], self.body(p.hashes[i]), meta=meta))

    def body(self, h: bytes) -> bytes:
        return hashlib.sha256(f"{self.name}/{self.version}".encode() + h).digest() * (BODY // 32)

    def close(self) -> None:
        self.client.close()


def _deployment(kind: str, root: Path, env: dict[str, str], request: pytest.FixtureRequest) -> list[Gateway]:
    """Two gateway processes of one deployment: on one data directory with shared ZMQ addresses (one machine), or
    replicas over PostgreSQL and SeaweedFS, each with its own addresses (two hosts)."""
    if kind == "one machine":  # one after the other: two processes migrating a new SQLite file at once collide
        ports = (free_port(), free_port())
        return [events_gateway(root / "data", env=env, ports=ports).start() for _ in range(2)]
    seaweed = request.getfixturevalue("seaweedfs_server")
    env = {**env, **seaweed.backend_env(bucket=unique_bucket(), prefix="kv")}
    env["KVGATE_DB_URL"] = request.getfixturevalue("pg_db")
    gateways = [events_gateway(root / name, env=env) for name in ("a", "b")]
    with ThreadPoolExecutor(2) as pool:
        for started in [pool.submit(g.start) for g in gateways]:
            started.result()
    return gateways


@pytest.mark.parametrize("kind", ["one machine", "replicas"])
def test_router_index_from_events_equals_lookup(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    rnd = random.Random(7)
    env = {
        "KVGATE_MAX_BYTES": str(80 * BODY),
        "KVGATE_HIGH_WATERMARK": "0.9",
        "KVGATE_LOW_WATERMARK": "0.7",
        "KVGATE_EVICTION_INTERVAL_S": "0.2",
        "KVGATE_META_CACHE_TTL_S": "0",
    }
    gateways = _deployment(kind, tmp_path, env, request)
    gw = gateways[0]
    pubs = sorted({g.pub for g in gateways})  # type: ignore[attr-defined]
    replays = sorted({g.replay for g in gateways})  # type: ignore[attr-defined]
    router = Router(pub=pubs, replay=replays, url=gw.url)
    engines: list[Engine] = []
    systems = {m: [[rnd.randrange(50_000) for _ in range(BLOCK)] for _ in range(3)] for m in MODELS}

    def new_prompt(model: str) -> Prompt:
        user = [[rnd.randrange(50_000) for _ in range(BLOCK)] for _ in range(rnd.randint(1, 6))]
        return prompt(model, systems[model][: rnd.randint(0, 3)] + user)

    def serve_some(n: int, models: tuple[str, ...] = tuple(MODELS)) -> None:
        for _ in range(n):
            for engine in engines:
                engine.serve(new_prompt(rnd.choice(models)))

    checked: list[tuple[str, int, int]] = []

    def settled() -> None:
        """Every process's background eviction has finished (one process's round may still remove blocks after
        another's stats read under the high mark: its round goes on to the low one)."""
        for g in gateways:
            with httpx.Client(base_url=g.url, timeout=30) as http:
                settled_stats(http)

    def checkpoint(name: str) -> None:
        settled()
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            router.catch_up(hello(gw.url)["next_seq"])
            for _ in range(40):
                model = rnd.choice(list(MODELS))
                mine = [p for p in router.routed if p.model == model]
                base = rnd.choice(mine).blocks if mine and rnd.random() < 0.8 else systems[model]
                blocks = base[: rnd.randint(1, len(base))]
                if rnd.random() < 0.3:  # another continuation of a known prefix
                    blocks = [*blocks, [rnd.randrange(50_000) for _ in range(BLOCK)]]
                p = prompt(model, blocks)
                resp = http.post("/v1/lookup", json={"keys": p.keys()})
                assert resp.status_code == 200, resp.text
                theirs = resp.json()["prefix"]
                ours = router.longest_prefix(model, blocks)
                first_apart = p.hashes[min(ours, theirs)] if min(ours, theirs) < len(blocks) else None
                history = first_apart and router.history.get((model, int.from_bytes(first_apart[-8:], "big")))
                assert ours == theirs, (  # a string, not a tuple: pytest would cut the tuple's repr short
                    f"{name}: {model}, {len(blocks)} blocks, router {ours}, lookup {theirs}; {dict(router.counts)}; "
                    f"events (seq, type) of block {min(ours, theirs)}: {history}"
                )
                checked.append((name, ours, len(blocks)))

    try:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            for model, ns in MODELS.items():
                assert http.put(f"/v1/namespaces/{ns}/config", json=agnostic_fields(model)).status_code in (200, 201)
        router.expected = hello(gw.url)["next_seq"]
        engines += [Engine("e1", gateways[0].url, router), Engine("e2", gateways[1].url, router)]

        serve_some(4)
        checkpoint("stored")

        for p in rnd.sample(router.routed, 4):  # another engine writes other bytes under the same keys
            engines[1].overwrite(p, rnd.randrange(len(p.blocks)))
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            for p in rnd.sample(router.routed, 4):
                http.delete(f"/v1/blocks/{p.keys()[rnd.randrange(len(p.keys()))]}")
        checkpoint("overwritten and deleted")

        replayed = router.counts["replayed"]
        router.disconnect()  # not listening: what is published meanwhile, it misses
        serve_some(2)
        router.connect()
        checkpoint("a gap")
        assert router.counts["replayed"] > replayed  # filled by replay

        serve_some(8)  # past the capacity bound: blocks evicted
        checkpoint("evicted")
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert sum(h.get("/v1/stats").json()["evictions"] for h in [http]) + _evictions(gateways[1]) > 0

        if kind == "one machine":  # kvgate gc, a process of its own, drops a block whose data went missing
            with httpx.Client(base_url=gw.url, timeout=30) as http:
                held = [k for p in router.routed for k, s in zip(p.keys(), _present(http, p), strict=True) if s]
            (tmp_path / "data" / "blocks" / held[0]).unlink()
            assert run_gc(tmp_path / "data", env={"KVGATE_EVENTS_ENABLED": "true"})["rows_dropped"] == 1
            checkpoint("gc")

        serve_some(2)
        settled()  # nothing commits during the restart
        before = hello(gw.url)["next_seq"]
        gw.restart()  # in the middle of the traffic; the other process publishes meanwhile
        assert hello(gw.url)["next_seq"] == before  # nothing committed meanwhile: the numbers go on, no jump
        serve_some(2)
        checkpoint("restarted")

        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert http.delete(f"/v1/namespaces/{MODELS['test-org/model-b']}").status_code == 200
        serve_some(2, models=("test-org/model-a",))
        checkpoint("purged")

        # each child's store came after its parent's (the engines PUT a prompt's blocks at once): an llm-d indexer
        # drops a store whose parent it does not know; this router parks it (45-54 a run without app/events/order.py)
        assert router.counts["orphans"] == 0
        assert router.counts["resyncs"] == 0  # every gap was filled by a replay, across the restart too
        assert router.counts["twice"] == 0  # one publisher at a time
        assert sum(ours > 0 for _n, ours, _l in checked) >= 40  # the answers were not all misses
        assert any(0 < ours < length for _n, ours, length in checked)  # and some partial
        print(f"router ({kind}): {router.counts}, {len(checked)} prompts checked")
    finally:
        for engine in engines:
            engine.close()
        router.close()
        for g in gateways:
            g.stop()


def _present(http: httpx.Client, p: Prompt) -> list[bool]:
    resp = http.post("/v1/lookup", json={"keys": p.keys()})
    assert resp.status_code == 200, resp.text
    return [slot["present"] for slot in resp.json()["blocks"]]


def _evictions(gw: Gateway) -> int:
    evictions: int = httpx.get(f"{gw.url}/v1/stats", timeout=30).json()["evictions"]
    return evictions
