"""A SeaweedFS restart and a PostgreSQL restart under load, against one gateway on SeaweedFS + PostgreSQL.

Writers (each owning its keys: fresh keys, overwrites, now and then a multi-part-sized body) and readers (GET, HEAD,
lookup of keys with an acknowledged version) run while the object store, then in another test the database, is
killed and started again on the same port and data. Every answer is recorded with the phase it was sent and
answered in. What must hold:
- every request gets an HTTP answer (save a GET whose 200 body was streaming when the store died: it is cut short,
  which the client sees), and the only 5xx is 503 (``backend_unavailable`` / ``index_unavailable``);
- a block with an acknowledged version is never a 404, a lookup of such blocks never a miss: while the store is
  down a GET is a 503 (HEAD and lookup answer from the index), while the database is down every answer is a 503;
- afterwards the same gateway process recovers by itself (PUTs acknowledged again, /readyz 200), and every key
  holds its last acknowledged version or a later attempt: nothing acknowledged is lost, and every body hashes to
  its ETag.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for
from tests.gateway import Gateway
from tests.services import (
    LocalPostgres,
    SeaweedServer,
    local_postgres,
    own_seaweedfs,
    start_or_skip,
    start_postgres_or_skip,
    unique_bucket,
)

MiB = 1024 * 1024
WRITERS, READERS = 4, 2
MAX_REQUESTS = 2000
"""Per client: the loops end by themselves even if the controller never says stop."""
DOWN_S = 3.0
"""How long the load runs against the dead server."""
ROUNDS = 2
"""Kills and restarts per test."""
OUTAGE_CODES = {"backend_unavailable", "index_unavailable"}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class Attempt:
    digest: str
    acked: bool = False


@dataclass
class Run:
    """The phase the system is in, and everything the clients sent and were told."""

    phase: str = "up"
    """up -> killing -> down -> restarting -> back"""
    attempts: dict[str, list[Attempt]] = field(default_factory=dict)
    """Per key, every PUT sent to it in order (a key has one writer)."""
    answers: Counter[tuple[str, str, int]] = field(default_factory=Counter)
    """(operation, phase sent -> phase answered, status) -> count."""
    wrong: list[str] = field(default_factory=list)
    acks_back: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def acked_from(self, key: str) -> int | None:
        """Index of the last acknowledged attempt on ``key``, or None."""
        tries = self.attempts.get(key, [])
        return next((i for i in range(len(tries) - 1, -1, -1) if tries[i].acked), None)

    def acked_keys(self) -> list[str]:
        return [k for k in self.attempts if self.acked_from(k) is not None]

    def bad(self, what: str) -> None:
        if len(self.wrong) < 50:
            self.wrong.append(what)

    def record(self, op: str, sent: str, r: httpx.Response) -> None:
        self.answers[(op, f"{sent}->{self.phase}", r.status_code)] += 1
        if r.status_code >= 500 and r.status_code != 503:
            self.bad(f"{op}: {r.status_code} {r.text[:200]}")
        if r.status_code == 503:
            code = r.json()["error"]["code"] if op != "HEAD" else "backend_unavailable"  # a HEAD has no body
            if code not in OUTAGE_CODES or not r.headers.get("Retry-After"):
                self.bad(f"{op}: 503 {code}, Retry-After {r.headers.get('Retry-After')}")


async def _send(run: Run, op: str, call: Awaitable[httpx.Response]) -> httpx.Response | None:
    sent = run.phase
    try:
        r = await call
    except httpx.RemoteProtocolError as exc:
        # a GET whose 200 was streaming when the store died: its body is cut short (the client sees it by the
        # Content-Length), since the status line is gone already; any other request must get an answer
        cut = op == "GET" and run.phase in ("killing", "down") and "complete message body" in str(exc)
        run.answers[(op, f"{sent}->{run.phase}", 0)] += 1
        if not cut:
            run.bad(f"{op} sent in {sent}: no answer: {type(exc).__name__}: {exc}")
        return None
    except httpx.HTTPError as exc:
        run.bad(f"{op} sent in {sent}: no answer: {type(exc).__name__}: {exc}")
        return None
    run.record(op, sent, r)
    if r.status_code == 503:
        await asyncio.sleep(0.02)  # a client backs off on an outage
    return r


async def writer(c: httpx.AsyncClient, run: Run, w: int) -> None:
    rng = random.Random(w)
    own = [key_for(100_000 * (w + 1) + i) for i in range(4)]
    for n in range(MAX_REQUESTS):
        if run.stop.is_set():
            return
        key = own[n % 4] if n % 3 == 0 else key_for(100_000 * (w + 1) + 10 + n)  # overwrites and fresh keys
        size = 6 * MiB + rng.randrange(1000) if n % 25 == 7 else rng.randrange(1, 64 * 1024)
        body = rng.randbytes(size)
        attempt = Attempt(sha(body))
        run.attempts.setdefault(key, []).append(attempt)
        r = await _send(run, "PUT", c.put(f"/v1/blocks/{key}", content=body, headers={"X-KVGate-SHA256": sha(body)}))
        if r is not None and r.status_code in (200, 201):
            attempt.acked = True
            run.acks_back += run.phase == "back"
        elif r is not None and r.status_code != 503:
            run.bad(f"PUT {key}: {r.status_code} {r.text[:200]}")


def check_body(run: Run, key: str, r: httpx.Response, *, since: int) -> None:
    """A 200 GET of ``key``: its bytes hash to its ETag, which names an attempt no older than ``since``."""
    tag = r.headers.get("etag", "").strip('"')
    if sha(r.content) != tag:
        run.bad(f"GET {key}: body {sha(r.content)[:12]} under ETag {tag[:12]}")
    if tag not in {a.digest for a in run.attempts[key][since:]}:
        run.bad(f"GET {key}: ETag {tag[:12]} is not its last acknowledged version or a later one")


async def reader(c: httpx.AsyncClient, run: Run, seed: int) -> None:
    rng = random.Random(seed)
    for n in range(MAX_REQUESTS):
        if run.stop.is_set():
            return
        keys = run.acked_keys()
        if not keys:
            await asyncio.sleep(0.05)
            continue
        key = rng.choice(keys)
        since = run.acked_from(key)
        assert since is not None
        if n % 3 == 0:
            r = await _send(run, "GET", c.get(f"/v1/blocks/{key}"))
            if r is not None and r.status_code == 200:
                check_body(run, key, r, since=since)
        elif n % 3 == 1:
            r = await _send(run, "HEAD", c.head(f"/v1/blocks/{key}"))
        else:
            some = rng.sample(keys, min(8, len(keys)))
            r = await _send(run, "LOOKUP", c.post("/v1/lookup", json={"keys": some}))
            if r is not None and r.status_code == 200 and r.json()["prefix"] != len(some):
                run.bad(f"lookup of {len(some)} acknowledged keys: prefix {r.json()['prefix']}")
        if r is not None and r.status_code not in (200, 503):
            run.bad(f"read of acknowledged {key}: {r.status_code} {r.text[:200]}")


async def under_load(url: str, *, kill: Callable[[], None], start: Callable[[], object]) -> Run:
    """The load, with ``kill`` and ``start`` of one server in the middle of it; returns what was seen."""
    run = Run()
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as c:
        clients = [asyncio.create_task(writer(c, run, w)) for w in range(WRITERS)]
        clients += [asyncio.create_task(reader(c, run, 1000 + r)) for r in range(READERS)]
        try:
            deadline = time.monotonic() + 120
            while len(run.acked_keys()) < 30 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            for _ in range(ROUNDS):
                run.phase = "killing"
                await asyncio.to_thread(kill)
                run.phase = "down"
                await asyncio.sleep(DOWN_S)
                run.phase = "restarting"
                await asyncio.to_thread(start)
                run.acks_back, run.phase = 0, "back"
                deadline = time.monotonic() + 120
                while run.acks_back < 30 and time.monotonic() < deadline:  # recovery, without a gateway restart
                    await asyncio.sleep(0.1)
                if run.acks_back < 30:
                    run.bad(f"no recovery: {run.acks_back} PUTs acknowledged in the 120 s after the restart")
        finally:
            run.stop.set()
            await asyncio.gather(*clients)
    return run


def answered(run: Run, op: str, *, during: str) -> Counter[int]:
    """Statuses of ``op`` sent and answered while the system was ``during``."""
    return Counter({s: n for (o, p, s), n in run.answers.items() if o == op and p == f"{during}->{during}"})


def check_refused_while_down(run: Run, op: str) -> None:
    """``op`` while the server was down: every one sent and answered in the outage was a 503, and some were sent in
    it and refused. A request sent late in the outage may be answered once the restart has begun (the gateway's
    own retries of the store take a while), with a 503 or, the server being back, its answer: not counted here."""
    assert set(answered(run, op, during="down")) <= {503}, (op, run.answers)
    sent_down = Counter({s: n for (o, p, s), n in run.answers.items() if o == op and p.startswith("down->")})
    assert sent_down[503] > 0, (op, run.answers)


def check_after(gw: Gateway, run: Run) -> None:
    """Every key holds its last acknowledged version or a later attempt; HEAD, GET and lookup agree."""
    acked = run.acked_keys()
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        assert c.get("/readyz").status_code == 200
        for key in run.attempts:
            since = run.acked_from(key)
            r = c.get(f"/v1/blocks/{key}")
            if since is None:  # never acknowledged: absent, or one of the attempts
                assert r.status_code in (200, 404), (key, r.status_code, r.text)
                since = 0
            else:
                assert r.status_code == 200, (key, r.status_code, r.text)
            if r.status_code == 200:
                check_body(run, key, r, since=since)
                h = c.head(f"/v1/blocks/{key}")
                assert h.status_code == 200 and h.headers["etag"] == r.headers["etag"], (key, h.status_code)
                assert int(h.headers["content-length"]) == len(r.content)
        for pos in range(0, len(acked), 500):
            batch = acked[pos : pos + 500]
            assert c.post("/v1/lookup", json={"keys": batch}).json()["prefix"] == len(batch)
    assert not run.wrong, run.wrong
    assert gw.proc is not None and gw.proc.poll() is None, "the gateway was restarted or died"


def report(run: Run, what: str) -> None:
    acked = sum(a.acked for tries in run.attempts.values() for a in tries)
    sent = sum(len(tries) for tries in run.attempts.values())
    print(f"{what}: {sent} PUTs, {acked} acknowledged, {len(run.attempts)} keys; answers {dict(run.answers)}")


# -- the two outages -------------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SeaweedServer]:
    server = start_or_skip(own_seaweedfs(root=tmp_path / "seaweedfs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def database() -> Iterator[tuple[LocalPostgres, str]]:
    local = local_postgres()
    server = start_postgres_or_skip(local)
    try:
        yield local, asyncio.run(server.create_database())
    finally:
        local.stop()


def gateway_env(store: SeaweedServer, db_url: str) -> dict[str, str]:
    return {
        **store.backend_env(bucket=unique_bucket(), prefix="kv"),
        "KVGATE_DB_URL": db_url,
        "KVGATE_BACKEND__MULTIPART_THRESHOLD_BYTES": str(5 * MiB),
        "KVGATE_BACKEND__PART_BYTES": str(5 * MiB),
    }


def test_seaweedfs_restart_under_load(
    tmp_path: Path, store: SeaweedServer, database: tuple[LocalPostgres, str]
) -> None:
    gw = Gateway(tmp_path / "gw", env=gateway_env(store, database[1])).start()
    try:
        run = asyncio.run(under_load(gw.url, kill=store.kill, start=store.start))
        report(run, "SeaweedFS kill -9 and restart")
        check_refused_while_down(run, "PUT")
        check_refused_while_down(run, "GET")
        assert set(answered(run, "HEAD", during="down")) <= {200, 503}  # HEAD and lookup answer from the index
        check_after(gw, run)
    finally:
        gw.stop()


def test_postgres_restart_under_load(
    tmp_path: Path, seaweedfs_server: SeaweedServer, database: tuple[LocalPostgres, str]
) -> None:
    pg, db_url = database
    gw = Gateway(tmp_path / "gw", env=gateway_env(seaweedfs_server, db_url)).start()
    try:
        run = asyncio.run(under_load(gw.url, kill=pg.crash, start=pg.start))
        report(run, "PostgreSQL crash and restart")
        for op in ("PUT", "GET", "HEAD", "LOOKUP"):
            check_refused_while_down(run, op)
        check_after(gw, run)
    finally:
        gw.stop()
