"""A history checker: mixed traffic against real gateway processes, every request and answer recorded, and each
key's final state (and every read along the way) explained by that history.

Writes are PUTs of new bodies (each body is unique, so a body names the write that made it), create-only PUTs,
DELETEs and multi-part objects (each with a total size of its own, so two uploads of one key never mix their
parts: the later one is refused). An answer is **ok** (2xx, the change happened), **failed** (a 4xx, or a request
never sent: nothing happened) or **unknown** (no answer: the gateway was killed, or a 5xx). Reads are GET, HEAD and
lookup.

What is checked (a necessary condition of linearizability per key, without the search):
- every body is served under its own ETag, and is the body of a write that was ok or unknown;
- a read's value (a body, or absent) was possible then: made by an op that began before the read ended and was
  not surely replaced before the read began (an ok op that began after it ended and ended before the read began);
- a key's final value is the value of an op that no ok op surely follows; nothing acknowledged is lost except to a
  later acknowledged change;
- at the end HEAD, GET, lookup, the index rows, the stored objects and /v1/stats agree;
- a key whose stored bytes the nemesis corrupted (tests/e2e/nemesis.py) may be absent from then on, until an
  acknowledged write of it: lost, never served wrong (a body that is not its ETag's is counted as refused by the
  client's check; a body matching an ETag nobody wrote is still a problem).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx

from tests.conftest import crc, key_for

Outcome = Literal["ok", "failed", "unknown"]
Kind = Literal["put", "create", "delete", "parts", "import"]


def digest_of(data: bytes) -> str:
    """A body's checksum token as the gateway records it (every write here sends none: CRC64NVME) and quotes it in
    its ETag: the history's name for the body."""
    return crc(data)


@dataclass(slots=True)
class Op:
    kind: Kind
    key: str
    value: str | None
    """The body's checksum token this op writes (None: a delete), as the gateway's ETag quotes it."""
    start: float
    end: float = 0.0
    outcome: Outcome = "unknown"


@dataclass(slots=True)
class Read:
    key: str
    value: str | None
    start: float
    end: float
    how: str


@dataclass
class History:
    ops: list[Op] = field(default_factory=list)
    reads: list[Read] = field(default_factory=list)
    bodies: set[str] = field(default_factory=set)
    statuses: Counter[str] = field(default_factory=Counter)
    corrupted: dict[str, list[list[float]]] = field(default_factory=dict)
    """Keys whose stored bytes the nemesis changed (tests/e2e/nemesis.py), each time as [began, ended]: from then
    on the key may be a miss, never served wrong, until an acknowledged write that began after it ended."""
    wrong: list[str] = field(default_factory=list)
    """Bodies served as 200 under an ETag that is not theirs, on keys nobody corrupted."""

    def corrupt(self, key: str) -> list[float]:
        """The nemesis begins to change ``key``'s bytes; it sets the span's end (``inf`` until then)."""
        span = [time.monotonic(), float("inf")]
        self.corrupted.setdefault(key, []).append(span)
        return span

    def may_be_lost(self, key: str, at: float) -> bool:
        """``key`` absent (or its bytes not its ETag's) at ``at`` is explained by the nemesis corrupting them before,
        with no acknowledged write of the key since (its bytes are fresh)."""
        for began, ended in self.corrupted.get(key, ()):
            if began < at and not any(
                o.key == key and o.value is not None and o.outcome == "ok" and o.start > ended and o.end < at
                for o in self.ops
            ):
                return True
        return False

    def begin(self, kind: Kind, key: str, value: str | None) -> Op:
        op = Op(kind=kind, key=key, value=value, start=time.monotonic())
        self.ops.append(op)
        if value is not None:
            self.bodies.add(value)
        return op

    @staticmethod
    def end(op: Op, outcome: Outcome) -> None:
        op.end = time.monotonic()
        op.outcome = outcome


def outcome_of(status: int, *, ok: Sequence[int]) -> Outcome:
    if status in ok:
        return "ok"
    return "unknown" if status >= 500 else "failed"


# -- the traffic ------------------------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Random traffic over ``keys`` from ``workers`` clients, each request to one of the live gateways."""

    urls: Callable[[], list[str]]
    keys: list[str]
    history: History
    seed: int = 0
    block: int = 16 * 1024

    async def run(self, *, workers: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=workers * 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(20.0, connect=2.0), limits=limits) as client:
            await asyncio.gather(*(self._worker(client, w, deadline) for w in range(workers)))

    async def _worker(self, client: httpx.AsyncClient, w: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + w)
        n = 0
        while time.monotonic() < deadline:
            n += 1
            key = rng.choice(self.keys)
            urls = self.urls()
            if not urls:
                await asyncio.sleep(0.05)
                continue
            url = rng.choice(urls)
            roll = rng.random()
            try:
                if roll < 0.30:
                    await self._put(client, url, key, rng, create=False)
                elif roll < 0.40:
                    await self._put(client, url, key, rng, create=True)
                elif roll < 0.50:
                    await self._delete(client, url, key)
                elif roll < 0.62:
                    await self._parts(client, key, rng, w, n)
                elif roll < 0.88:
                    await self._get(client, url, key)
                elif roll < 0.94:
                    await self._head(client, url, key)
                else:
                    await self._lookup(client, url, key)
            except httpx.HTTPError:
                pass  # recorded as unknown (or failed) where the op began

    async def _send(self, op: Op, send: Callable[[], object], ok: Sequence[int]) -> httpx.Response | None:
        try:
            r = await send()  # type: ignore[misc]
        except (httpx.ConnectError, httpx.ConnectTimeout):
            History.end(op, "failed")  # never sent: nothing happened
            self.history.statuses["not sent"] += 1
            return None
        except httpx.HTTPError:
            History.end(op, "unknown")
            self.history.statuses["no answer"] += 1
            return None
        assert isinstance(r, httpx.Response)
        History.end(op, outcome_of(r.status_code, ok=ok))
        self.history.statuses[f"{op.kind} {r.status_code}"] += 1
        return r

    async def _put(self, client: httpx.AsyncClient, url: str, key: str, rng: random.Random, *, create: bool) -> None:
        body = rng.randbytes(rng.randrange(self.block // 4, self.block))
        op = self.history.begin("create" if create else "put", key, digest_of(body))
        headers = {"If-None-Match": "*"} if create else {}
        await self._send(op, lambda: client.put(f"{url}/v1/blocks/{key}", content=body, headers=headers), (200, 201))

    async def _delete(self, client: httpx.AsyncClient, url: str, key: str) -> None:
        op = self.history.begin("delete", key, None)
        r = await self._send(op, lambda: client.delete(f"{url}/v1/blocks/{key}"), (204, 404))
        assert r is None or r.status_code in (204, 404) or r.status_code >= 500, (r.status_code, r.text)

    async def _parts(self, client: httpx.AsyncClient, key: str, rng: random.Random, w: int, n: int) -> None:
        """An object of a total size no other upload uses, in 2-4 parts sent in any order to any gateways."""
        total = self.block + (w * 100_003 + n) % self.block
        body = rng.randbytes(total)
        cuts = sorted({0, total, *(rng.randrange(1, total) for _ in range(rng.randrange(1, 4)))})
        spans = list(itertools.pairwise(cuts))
        rng.shuffle(spans)
        op = self.history.begin("parts", key, digest_of(body))
        answers: list[Outcome] = []
        complete = False
        for a, b in spans:
            urls = self.urls()
            if not urls:
                answers.append("failed")
                break
            headers = {"Content-Range": f"bytes {a}-{b - 1}/{total}"}
            try:
                r = await client.put(f"{rng.choice(urls)}/v1/blocks/{key}", content=body[a:b], headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                answers.append("failed")
                continue
            except httpx.HTTPError:
                answers.append("unknown")
                continue
            self.history.statuses[f"part {r.status_code}"] += 1
            complete = complete or r.status_code == 201
            answers.append("unknown" if r.status_code >= 500 else "ok" if r.status_code in (201, 202) else "failed")
        History.end(op, "ok" if complete else "unknown" if "unknown" in answers else "failed")

    async def _get(self, client: httpx.AsyncClient, url: str, key: str) -> None:
        start = time.monotonic()
        r = await client.get(f"{url}/v1/blocks/{key}")
        end = time.monotonic()
        self.history.statuses[f"get {r.status_code}"] += 1
        if r.status_code == 200:
            value = digest_of(r.content)
            if r.headers["etag"] != f'"{value}"':
                if self.history.may_be_lost(key, end):
                    self.history.statuses["get 200 corrupt, refused by its ETag"] += 1
                else:
                    self.history.wrong.append(f"{key}: GET served a body under another body's ETag")
                return
            self.history.reads.append(Read(key, value, start, end, "GET"))
        elif r.status_code == 404:
            self.history.reads.append(Read(key, None, start, end, "GET"))

    async def _head(self, client: httpx.AsyncClient, url: str, key: str) -> None:
        start = time.monotonic()
        r = await client.head(f"{url}/v1/blocks/{key}")
        end = time.monotonic()
        self.history.statuses[f"head {r.status_code}"] += 1
        if r.status_code in (200, 404):
            value = r.headers["etag"].strip('"') if r.status_code == 200 else None
            self.history.reads.append(Read(key, value, start, end, "HEAD"))

    async def _lookup(self, client: httpx.AsyncClient, url: str, key: str) -> None:
        start = time.monotonic()
        r = await client.post(f"{url}/v1/lookup", json={"keys": [key]})
        end = time.monotonic()
        self.history.statuses[f"lookup {r.status_code}"] += 1
        if r.status_code == 200:
            slot = r.json()["blocks"][0]
            value = slot["etag"].strip('"') if slot["present"] else None
            self.history.reads.append(Read(key, value, start, end, "lookup"))


# -- the checks -------------------------------------------------------------------------------------------------


@dataclass
class Verdict:
    keys: int
    ops: Counter[str]
    reads: int
    final_present: int
    problems: list[str]

    def summary(self) -> str:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items()))
        return (
            f"history: {sum(self.ops.values())} ops ({ops}), {self.reads} reads checked, {self.keys} keys, "
            f"{self.final_present} present at the end, {len(self.problems)} problems"
        )


def _possible(ops: list[Op], value: str | None, start: float, end: float) -> bool:
    """Could ``value`` be the key's value at some point in [start, end], given its ops?"""
    makers = [o for o in ops if o.value == value and o.outcome != "failed" and o.start < end]
    if value is None:
        makers.append(Op(kind="delete", key="", value=None, start=-1.0, end=-1.0, outcome="ok"))  # initially absent
    for m in makers:
        replaced = any(o is not m and o.outcome == "ok" and o.start > m.end and o.end < start for o in ops)
        if not replaced:
            return True
    return False


def check(history: History, final: dict[str, str | None]) -> Verdict:
    """Every read and every key's final value explained by the history (see the module docstring)."""
    by_key: dict[str, list[Op]] = {}
    for op in history.ops:
        by_key.setdefault(op.key, []).append(op)
    problems: list[str] = list(history.wrong)
    for read in history.reads:
        if read.value is not None and read.value not in history.bodies:
            problems.append(f"{read.key}: {read.how} answered a body nobody wrote ({read.value[:12]})")
        elif read.value is None and history.may_be_lost(read.key, read.end):
            continue
        elif not _possible(by_key.get(read.key, []), read.value, read.start, read.end):
            problems.append(f"{read.key}: {read.how} answered {(read.value or 'absent')[:12]}, not possible then")
    now = time.monotonic()
    for key, value in final.items():
        if value is None and history.may_be_lost(key, now):
            continue
        if not _possible(by_key.get(key, []), value, now, now):
            ops = by_key.get(key, [])
            last_ok = max((o for o in ops if o.outcome == "ok"), key=lambda o: o.end, default=None)
            problems.append(
                f"{key}: ends {(value or 'absent')[:12]}, not explained; last ok op "
                f"{last_ok.kind if last_ok else None} {(last_ok.value or 'absent')[:12] if last_ok else ''}"
            )
    return Verdict(
        keys=len(final),
        ops=Counter(f"{o.kind} {o.outcome}" for o in history.ops),
        reads=len(history.reads),
        final_present=sum(v is not None for v in final.values()),
        problems=problems,
    )


def final_state(url: str, keys: list[str]) -> dict[str, str | None]:
    """Each key's value as GET, HEAD and lookup answer it, which must agree; each body under its own ETag."""
    out: dict[str, str | None] = {}
    with httpx.Client(base_url=url, timeout=30) as c:
        look = c.post("/v1/lookup", json={"keys": keys}).json()["blocks"]
        for slot, key in zip(look, keys, strict=True):
            head, got = c.head(f"/v1/blocks/{key}"), c.get(f"/v1/blocks/{key}")
            if got.status_code == 404:
                assert head.status_code == 404 and not slot["present"], (key, head.status_code, slot)
                out[key] = None
                continue
            assert got.status_code == 200 and head.status_code == 200 and slot["present"], (key, got.status_code)
            value = digest_of(got.content)
            assert got.headers["etag"] == head.headers["etag"] == f'"{value}"' == slot["etag"], key
            out[key] = value
    return out


def workload_keys(n: int, *, base: int = 90_000) -> list[str]:
    return [key_for(base + i) for i in range(n)]
