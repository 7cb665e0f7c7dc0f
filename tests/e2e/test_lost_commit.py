"""A COMMIT whose reply is lost: PostgreSQL commits, the connection drops before the gateway hears so (a fault proxy
in front of the server, tests/pg_proxy.py). The outcome is unknown to the gateway, and it must never guess it: an
acknowledged change is visible afterwards with the bytes its ETag names, a change answered 503 may or may not have
happened, and nothing else is allowed (a 200 for a change that is lost, a 409 for a writer's own part, a 404 for a
DELETE of a present key)."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, matches, random_bytes
from tests.gateway import Gateway
from tests.pg_proxy import PgFaultProxy
from tests.services import MotoServer, asyncpg_dsn, unique_bucket

BLOCK = 4096
THREADS = 8
KEYS_PER_THREAD = 4
PART_KEYS = 6


@dataclasses.dataclass
class Outcomes:
    """One key's history as the client saw it: the states it may be in now (bytes, or None: absent)."""

    possible: list[bytes | None] = dataclasses.field(default_factory=lambda: [None])
    problems: list[str] = dataclasses.field(default_factory=list)
    answers: dict[str, int] = dataclasses.field(default_factory=lambda: {"acked": 0, "unknown": 0})

    def acked(self, state: bytes | None) -> None:
        self.possible = [state]
        self.answers["acked"] += 1

    def unknown(self, state: bytes | None) -> None:
        self.possible.append(state)
        self.answers["unknown"] += 1


@pytest.fixture(params=["fs", "s3"])
def proxied(request: pytest.FixtureRequest, tmp_path: Path, pg_db: str) -> Iterator[tuple[Gateway, PgFaultProxy]]:
    """A gateway whose index is PostgreSQL through the fault proxy, its blocks on the filesystem or on S3 (moto)."""
    upstream = int(pg_db.rsplit(":", 1)[1].split("/", 1)[0])
    proxy = PgFaultProxy(upstream_port=upstream, seed=41).start()
    # the replies lost are those of the changes' own commits (a block's or a part's row), not of an S3 version's
    # staging intent recorded before its bytes: that loss is a plain 503 before anything was staged
    proxy.lose_only = re.compile(rb"(?i)\b(blocks|parts)\b")
    env = {"KVGATE_DB_URL": proxy.url_for(pg_db)}
    if request.param == "s3":
        server: MotoServer = request.getfixturevalue("moto_server")
        env |= server.backend_env(bucket=unique_bucket(), prefix="kv")
    gateway = Gateway(tmp_path / "data", env=env)
    try:
        gateway.start()
        yield gateway, proxy
    finally:
        gateway.stop()
        proxy.stop()


def _blocks(c: httpx.Client, keys: list[str], seed: int) -> dict[str, Outcomes]:
    """PUT (new key), PUT (overwrite), DELETE, PUT again, on each key in turn."""
    seen = {key: Outcomes() for key in keys}
    for round_ in range(4):
        for n, key in enumerate(keys):
            out = seen[key]
            if round_ == 2:
                r = c.delete(f"/v1/blocks/{key}")
                if r.status_code == 204 or (r.status_code == 404 and None in out.possible):
                    out.acked(None)
                elif r.status_code == 503:
                    out.unknown(None)
                else:
                    out.problems.append(f"DELETE {key}: {r.status_code} {r.text} (may be {_shown(out.possible)})")
                continue
            data = random_bytes(BLOCK, seed * 1000 + n * 10 + round_)
            r = c.put(f"/v1/blocks/{key}", content=data)
            if r.status_code in (200, 201) and matches(r.json()["digest"], data):
                out.acked(data)
            elif r.status_code == 503:
                out.unknown(data)
            else:
                out.problems.append(f"PUT {key} round {round_}: {r.status_code} {r.text}")
    return seen


def _parts(c: httpx.Client, key: str, blob: bytes) -> Outcomes:
    """Two parts, each re-sent on a 503 (as a writer does) until answered."""
    out = Outcomes()
    for start in (0, BLOCK):
        headers = {"Content-Range": f"bytes {start}-{start + BLOCK - 1}/{2 * BLOCK}"}
        for _ in range(20):
            r = c.put(f"/v1/blocks/{key}", content=blob[start : start + BLOCK], headers=headers)
            if r.status_code != 503:
                break
        if r.status_code not in (200, 201, 202):
            out.problems.append(f"part {start} of {key}: {r.status_code} {r.text}")
            return out
    out.acked(blob)
    return out


def _shown(states: list[bytes | None]) -> list[str]:
    return ["absent" if s is None else f"{len(s)} bytes" for s in states]


def test_lost_commit_replies_lose_no_acknowledged_change(proxied: tuple[Gateway, PgFaultProxy]) -> None:
    """Half the COMMIT replies lost during PUTs of new keys, overwrites, DELETEs and parts, from 8 clients at once
    (the group commit shares transactions between them). Before, the writer re-ran the batch one change at a time;
    each re-run found its own committed row ("same bytes"), the staged version was discarded and the PUT answered
    200: a GET then answered 404 (new keys) or the previous version (overwrites); a part re-run answered 409 for
    the writer's own part."""
    gateway, proxy = proxied
    proxy.lose_rate = 0.5
    groups = [[key_for(41_000 + t * 100 + i) for i in range(KEYS_PER_THREAD)] for t in range(THREADS)]
    part_keys = [key_for(42_000 + i) for i in range(PART_KEYS)]
    blobs = {key: random_bytes(2 * BLOCK, 42_000 + i) for i, key in enumerate(part_keys)}
    with ThreadPoolExecutor(THREADS + PART_KEYS) as pool, httpx.Client(base_url=gateway.url, timeout=60) as c:
        block_runs = [pool.submit(_blocks, c, keys, seed) for seed, keys in enumerate(groups)]
        part_runs = {key: pool.submit(_parts, c, key, blob) for key, blob in blobs.items()}
        seen: dict[str, Outcomes] = {}
        for run in block_runs:
            seen.update(run.result())
        seen.update({key: run.result() for key, run in part_runs.items()})
    lost, proxy.lose_rate = proxy.lost, 0.0
    acked = sum(out.answers["acked"] for out in seen.values())
    unknown = sum(out.answers["unknown"] for out in seen.values())
    print(f"{lost} of {proxy.commits} COMMIT replies lost; changes acknowledged {acked}, answered 503 {unknown}")

    problems = [p for out in seen.values() for p in out.problems]
    with httpx.Client(base_url=gateway.url, timeout=60) as c:
        for key, out in seen.items():
            got = c.get(f"/v1/blocks/{key}")
            if got.status_code == 404:
                state = None
            elif got.status_code == 200 and matches(got.headers["etag"], got.content):
                state = got.content
            else:
                problems.append(f"GET {key}: {got.status_code} {got.headers.get('etag')}")
                continue
            if state not in out.possible:
                problems.append(f"GET {key}: {_shown([state])}, may be only {_shown(out.possible)}")
    assert problems == [], f"{len(problems)} problems ({lost} of {proxy.commits} COMMIT replies lost):\n" + "\n".join(
        problems[:40]
    )
    assert lost >= 10, f"only {lost} of {proxy.commits} COMMIT replies lost"
    assert unknown == 0  # every lost reply was settled by reading the row back


@pytest.mark.parametrize("overwrite", [False, True], ids=["new-key", "overwrite"])
def test_a_commit_that_cannot_be_read_back_is_kept_for_recovery(
    proxied: tuple[Gateway, PgFaultProxy], overwrite: bool
) -> None:
    """The COMMIT's reply is lost and the index is out of reach at once, so the gateway cannot read the row back: the
    PUT answers 503 and the staged version is kept. PostgreSQL did commit the row naming it: once the index is back,
    HEAD answers from that row, and GET serves the same version (recovery rolls it forward). Before, the staged data
    was discarded on any failed commit: GET then answered 404 (a new key) or the previous version (an overwrite),
    after HEAD had answered the new version's ETag."""
    gateway, proxy = proxied
    key, old, new = key_for(43_000), random_bytes(BLOCK, 1), random_bytes(BLOCK, 2)
    with httpx.Client(base_url=gateway.url, timeout=60) as c:
        if overwrite:
            assert c.put(f"/v1/blocks/{key}", content=old).status_code == 201
        proxy.lose_rate, proxy.down_after_loss = 1.0, True
        r = c.put(f"/v1/blocks/{key}", content=new)
        assert r.status_code == 503, r.text
        assert proxy.lost == 1
        proxy.lose_rate, proxy.down_after_loss = 0.0, False
        proxy.heal()
        head = c.head(f"/v1/blocks/{key}")
        assert head.status_code == 200 and matches(head.headers["etag"], new)
        got = c.get(f"/v1/blocks/{key}")
        assert got.status_code == 200, got.text
        assert got.content == new and got.headers["etag"] == head.headers["etag"]


def _usage_metric(c: httpx.Client) -> float:
    """``kvgate_usage_bytes`` of /metrics: the process's usage view as it stands (no read of the index)."""
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("kvgate_usage_bytes "):
            return float(line.split()[1])
    raise AssertionError("no kvgate_usage_bytes in /metrics")


def test_usage_counts_a_commit_once_when_a_refresh_reads_it_first(proxied: tuple[Gateway, PgFaultProxy]) -> None:
    """A PUT's transaction has committed on the server, its reply is slow to come (held by the proxy), and
    /v1/stats reads usage from the index meanwhile (``Capacity.refresh``): the read includes the PUT, and the
    PUT then adds its own bytes when its reply comes. Before, the view counted them twice until the next
    refresh (8192 for one 4096-byte block): admission and eviction decided from it."""
    gateway, proxy = proxied
    data = random_bytes(BLOCK, 3)
    with httpx.Client(base_url=gateway.url, timeout=60) as c, ThreadPoolExecutor(1) as pool:
        assert _usage_metric(c) == 0
        proxy.hold_s = 2.0
        put = pool.submit(c.put, f"/v1/blocks/{key_for(44_000)}", content=data)
        time.sleep(1.0)
        assert c.get("/v1/stats").status_code == 200
        assert put.result().status_code == 201
        proxy.hold_s = 0.0
        assert _usage_metric(c) == BLOCK
        assert c.get("/v1/stats").json()["usage_bytes"] == BLOCK


def test_a_part_whose_object_did_not_commit_keeps_its_data(tmp_path: Path, pg_db: str, moto_server: MotoServer) -> None:
    """On S3 each part is an object of its own. The last part is recorded (its transaction commits), then the
    object's COMMIT fails on the server (a deferred trigger raises: nothing committed); the PUT answers 503. The
    part's row stays, so its object must too. Before, the PUT's clean-up deleted the object of its recorded part:
    the writer's re-sent part was recognised as recorded, the assembly found its object gone, and the PUT answered
    404 (the object could never complete)."""
    env = {**moto_server.backend_env(bucket=unique_bucket(), prefix="kv"), "KVGATE_DB_URL": pg_db}
    gateway = Gateway(tmp_path / "data", env=env).start()
    key, blob = key_for(45_000), random_bytes(2 * BLOCK, 45)
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as c:

            def part(start: int) -> httpx.Response:
                headers = {"Content-Range": f"bytes {start}-{start + BLOCK - 1}/{2 * BLOCK}"}
                return c.put(f"/v1/blocks/{key}", content=blob[start : start + BLOCK], headers=headers)

            assert part(0).status_code == 202
            asyncio.run(
                _sql(
                    pg_db,
                    "CREATE FUNCTION test_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                    "RAISE EXCEPTION 'refused at commit'; END $$",
                    "CREATE CONSTRAINT TRIGGER test_refuse_blocks AFTER INSERT ON blocks DEFERRABLE INITIALLY "
                    "DEFERRED FOR EACH ROW EXECUTE FUNCTION test_refuse()",
                )
            )
            assert part(BLOCK).status_code == 503
            asyncio.run(_sql(pg_db, "DROP TRIGGER test_refuse_blocks ON blocks"))
            again = part(BLOCK)
            assert again.status_code in (200, 201), again.text
            got = c.get(f"/v1/blocks/{key}")
            assert got.status_code == 200 and got.content == blob and matches(got.headers["etag"], blob)
    finally:
        gateway.stop()


async def _sql(db_url: str, *statements: str) -> None:
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(asyncpg_dsn(db_url))
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()
