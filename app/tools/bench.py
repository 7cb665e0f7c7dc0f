"""``kvgate bench``: a one-process async load generator for kvgate (or any WebDAV-style server, e.g. nginx).

Runs phases (``put,get,head,lookup``) or one weighted ``--mix`` over a key space with a uniform or zipf
distribution, at a fixed concurrency. Every GET body is checked against the sha256 of what was PUT under that
key, so a speed is never reported for wrong data. Prints MB/s, req/s and p50/p99 latency per op, and writes the
same figures as JSON with ``--json``. The HTTP client (aiohttp or httpx) is swappable: measure it too.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from app.tools.bench_clients import Client, make_client
from app.tools.tls_client import CaCert, ClientCert, ClientKey, ClientTLS
from contract.keys import block_path
from contract.wire import format_block_meta

NAMESPACE = "kvgate-bench_000000000000"
OPS = ("put", "get", "head", "lookup")
MiB = 1024 * 1024


@dataclass
class OpStats:
    op: str
    requests: int = 0
    ok: int = 0
    misses: int = 0
    errors: int = 0
    verify_failures: int = 0
    bytes: int = 0
    seconds: float = 0.0
    mb_s: float = 0.0
    req_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    mean_ms: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)

    def finish(self, *, seconds: float) -> None:
        self.seconds = seconds
        self.mb_s = self.bytes / seconds / 1e6 if seconds > 0 else 0.0
        self.req_s = self.requests / seconds if seconds > 0 else 0.0
        lat = sorted(self.latencies)
        if lat:
            self.p50_ms = 1000 * lat[len(lat) // 2]
            self.p99_ms = 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            self.mean_ms = 1000 * sum(lat) / len(lat)

    def public(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("latencies")
        return out


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    url: str
    target: Literal["kvgate", "webdav"] = "kvgate"
    client: Literal["aiohttp", "httpx"] = "aiohttp"
    concurrency: int = 16
    block_size: int = 2 * MiB
    count: int = 128
    keys: int | None = None
    phases: str = "put,get,head"
    mix: str | None = None
    distribution: Literal["uniform", "zipf"] = "uniform"
    zipf_s: float = 1.1
    lookup_batch: int = 32
    seed: int = 0
    meta_tokens: int = 0
    """PUTs carry X-KVGate-Block-Meta with this many token ids and the previous key's hash (0: none)."""
    timeout_s: float = 120.0
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None

    @property
    def key_space(self) -> int:
        return self.keys or self.count


def bench_key(*, seed: int, i: int) -> str:
    """The ``i``-th key of a run: a valid FileMapper path, the same for every server (and the same on disk)."""
    h = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()
    return block_path(namespace=NAMESPACE, rank=0, block_hash=h, group=0)


class Payloads:
    """Distinct bytes per key without one buffer per key: key i is a window of one random buffer at offset 64*i."""

    STEP = 64

    def __init__(self, *, block_size: int, keys: int, seed: int) -> None:
        self.block_size = block_size
        self.keys = keys
        self._buf = random.Random(seed).randbytes(block_size + self.STEP * keys)
        self._digests: dict[int, str] = {}

    def body(self, i: int) -> memoryview:
        start = self.STEP * (i % self.keys)
        return memoryview(self._buf)[start : start + self.block_size]

    def digest(self, i: int) -> str:
        d = self._digests.get(i)
        if d is None:
            d = self._digests[i] = hashlib.sha256(self.body(i)).hexdigest()
        return d


class KeyPicker:
    def __init__(self, *, keys: int, distribution: str, zipf_s: float, rng: random.Random) -> None:
        self._n = keys
        self._rng = rng
        self._cdf: list[float] | None = None
        if distribution == "zipf":
            weights = [1.0 / (r + 1) ** zipf_s for r in range(keys)]
            total = sum(weights)
            acc = 0.0
            self._cdf = []
            for w in weights:
                acc += w / total
                self._cdf.append(acc)
            # shuffle which key gets which rank, so hot keys are spread over the directory tree
            self._perm = list(range(keys))
            rng.shuffle(self._perm)

    def pick(self) -> int:
        if self._cdf is None:
            return self._rng.randrange(self._n)
        rank = min(bisect.bisect_left(self._cdf, self._rng.random()), self._n - 1)
        return self._perm[rank]


def parse_weights(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in spec.split(","):
        name, _, weight = item.strip().partition("=")
        if name not in OPS:
            raise ValueError(f"unknown op {name!r} (ops: {', '.join(OPS)})")
        out[name] = float(weight or 1)
    return out


def parse_phases(spec: str, count: int) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for item in spec.split(","):
        name, _, n = item.strip().partition(":")
        if name not in OPS:
            raise ValueError(f"unknown op {name!r} (ops: {', '.join(OPS)})")
        out.append((name, int(n) if n else count))
    return out


class Runner:
    def __init__(self, cfg: BenchConfig, client: Client) -> None:
        self.cfg = cfg
        self.client = client
        self.payloads = Payloads(block_size=cfg.block_size, keys=cfg.key_space, seed=cfg.seed)
        self.rng = random.Random(cfg.seed + 1)
        self.picker = KeyPicker(keys=cfg.key_space, distribution=cfg.distribution, zipf_s=cfg.zipf_s, rng=self.rng)
        self.written: set[int] = set()
        self.first_errors: list[str] = []
        self.prefix = "/v1/blocks/" if cfg.target == "kvgate" else "/"

    def key(self, i: int) -> str:
        return bench_key(seed=self.cfg.seed, i=i)

    def meta(self, i: int) -> str | None:
        """Key ``i``'s block meta: the previous key's hash as its parent, and ``meta_tokens`` token ids."""
        n = self.cfg.meta_tokens
        if not n:
            return None
        parent = self.key(i - 1).rsplit("/", 1)[1].removesuffix(".bin") if i else None
        return format_block_meta(parent=parent, tokens=[(i * n + j) % 50_000 for j in range(n)])

    def _error(self, stats: OpStats, msg: str) -> None:
        stats.errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(f"{stats.op}: {msg}")

    async def do(self, op: str, i: int, stats: OpStats) -> None:
        url = self.prefix + self.key(i)
        t0 = time.perf_counter()
        try:
            if op == "put":
                status = await self.client.put(url, self.payloads.body(i), meta=self.meta(i))
                if status in (200, 201, 204):
                    stats.ok += 1
                    stats.bytes += self.cfg.block_size
                    self.written.add(i)
                else:
                    self._error(stats, f"status {status}")
            elif op == "get":
                status, size, digest = await self.client.get(url)
                if status == 200:
                    if size != self.cfg.block_size or digest != self.payloads.digest(i):
                        stats.verify_failures += 1
                        self._error(stats, f"wrong bytes for key {i}: {size} bytes sha256 {digest[:12]}")
                    else:
                        stats.ok += 1
                        stats.bytes += size
                elif status == 404 and i not in self.written:
                    stats.misses += 1
                else:
                    self._error(stats, f"status {status}")
            elif op == "head":
                status, length = await self.client.head(url)
                if status == 200 and length == self.cfg.block_size:
                    stats.ok += 1
                elif status == 404 and i not in self.written:
                    stats.misses += 1
                else:
                    self._error(stats, f"status {status} length {length}")
            else:
                keys = [self.key((i + j) % self.cfg.key_space) for j in range(self.cfg.lookup_batch)]
                status = await self.client.lookup("/v1/lookup", keys)
                if status == 200:
                    stats.ok += 1
                else:
                    self._error(stats, f"status {status}")
        except Exception as exc:  # a failed request is a counted error, not a crash of the run
            self._error(stats, f"{type(exc).__name__}: {exc}")
        stats.requests += 1
        stats.latencies.append(time.perf_counter() - t0)

    async def phase(
        self, jobs: Iterator[tuple[str, int]], total: int, stats: dict[str, OpStats], tick: Callable[[int], None]
    ) -> None:
        async def worker() -> None:
            for op, i in jobs:  # a shared iterator: each job is taken once
                await self.do(op, i, stats[op])
                tick(self.cfg.block_size if op in ("put", "get") else 0)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(self.cfg.concurrency, max(total, 1)))))
        seconds = time.perf_counter() - start
        for s in stats.values():
            s.finish(seconds=seconds)

    def jobs_for(self, op: str, n: int) -> Iterator[tuple[str, int]]:
        for r in range(n):
            # PUT walks the key space in order so that a following GET/HEAD phase finds every key
            yield op, (r % self.cfg.key_space) if op == "put" else self.picker.pick()

    def mixed_jobs(self, weights: dict[str, float], n: int) -> Iterator[tuple[str, int]]:
        names, w = list(weights), list(weights.values())
        for _ in range(n):
            yield self.rng.choices(names, weights=w)[0], self.picker.pick()


async def run_bench(cfg: BenchConfig, *, progress: bool = True) -> dict[str, Any]:
    """Run the configured phases; returns the JSON-able result."""
    plan: list[tuple[str, int, dict[str, float] | None]] = (
        [("mix", cfg.count, parse_weights(cfg.mix))]
        if cfg.mix
        else [(op, n, None) for op, n in parse_phases(cfg.phases, cfg.count)]
    )
    tls = ClientTLS(
        cacert=Path(cfg.cacert) if cfg.cacert else None,
        cert=Path(cfg.cert) if cfg.cert else None,
        key=Path(cfg.key) if cfg.key else None,
    )
    client = make_client(
        cfg.client,
        base_url=cfg.url,
        concurrency=cfg.concurrency,
        timeout_s=cfg.timeout_s,
        tls=tls.context() if cfg.url.startswith("https://") else None,
    )
    results: list[dict[str, Any]] = []
    runner = Runner(cfg, client)
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("{task.description:>8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            disable=not progress,
            transient=False,
        ) as bar:
            for name, n, weights in plan:
                if cfg.target != "kvgate" and name == "lookup":
                    results.append({"phase": name, "skipped": "lookup is a kvgate call", "ops": {}})
                    continue
                ops = list(weights) if weights else [name]
                stats = {op: OpStats(op=op) for op in ops}
                task = bar.add_task(name, total=n, rate="")
                t0 = time.perf_counter()
                moved = [0]

                def tick(nbytes: int, task: Any = task, t0: float = t0, moved: list[int] = moved) -> None:
                    moved[0] += nbytes
                    dt = time.perf_counter() - t0
                    bar.update(task, advance=1, rate=f"{moved[0] / dt / 1e6:8.1f} MB/s" if dt > 0 else "")

                jobs = runner.mixed_jobs(weights, n) if weights else runner.jobs_for(name, n)
                await runner.phase(jobs, n, stats, tick)
                results.append({"phase": name, "ops": {op: s.public() for op, s in stats.items()}})
    finally:
        await client.aclose()
    cfg_out = asdict(cfg)
    return {
        "config": cfg_out,
        "phases": results,
        "errors": sum(o["errors"] for p in results for o in p["ops"].values()),
        "verify_failures": sum(o["verify_failures"] for p in results for o in p["ops"].values()),
        "first_errors": runner.first_errors,
    }


def print_result(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    c = result["config"]
    table = Table(
        title=f"kvgate bench: {c['target']} {c['url']}  client={c['client']}  concurrency={c['concurrency']}  "
        f"block={c['block_size']} B  keys={c['keys'] or c['count']} ({c['distribution']})"
    )
    for col in ("phase", "op", "requests", "ok", "miss", "err", "MB/s", "req/s", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right")
    for p in result["phases"]:
        if "skipped" in p:
            table.add_row(p["phase"], "-", "", "", "", "", "", "", "", "", end_section=False)
            continue
        for op, s in p["ops"].items():
            table.add_row(
                p["phase"],
                op,
                str(s["requests"]),
                str(s["ok"]),
                str(s["misses"]),
                str(s["errors"] + s["verify_failures"]),
                f"{s['mb_s']:.1f}",
                f"{s['req_s']:.0f}",
                f"{s['p50_ms']:.2f}",
                f"{s['p99_ms']:.2f}",
            )
    Console().print(table)
    for e in result["first_errors"]:
        Console(stderr=True).print(f"[red]error[/red] {e}")


def bench_command(
    url: Annotated[str, typer.Option(help="server base URL")] = "http://127.0.0.1:8750",
    target: Annotated[str, typer.Option(help="kvgate (/v1/blocks/<key>) or webdav (/<key>, e.g. nginx)")] = "kvgate",
    client: Annotated[str, typer.Option(help="HTTP client: aiohttp or httpx")] = "aiohttp",
    concurrency: Annotated[int, typer.Option("--concurrency", "-c", min=1, help="requests in flight")] = 16,
    block_size: Annotated[int, typer.Option(min=1, help="bytes per block")] = 2 * MiB,
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="requests per phase")] = 128,
    keys: Annotated[int | None, typer.Option(min=1, help="key space (default: --count)")] = None,
    phases: Annotated[str, typer.Option(help="phases in order, each op[:count]: put,get,head,lookup")] = "put,get,head",
    mix: Annotated[str | None, typer.Option(help="one mixed phase instead, e.g. put=1,get=8,head=1")] = None,
    distribution: Annotated[str, typer.Option(help="key distribution for get/head/mix: uniform or zipf")] = "uniform",
    zipf_s: Annotated[float, typer.Option(help="zipf exponent")] = 1.1,
    lookup_batch: Annotated[int, typer.Option(min=1, help="keys per lookup call")] = 32,
    meta_tokens: Annotated[
        int, typer.Option(min=0, help="PUTs carry X-KVGate-Block-Meta with this many token ids and a parent")
    ] = 0,
    seed: Annotated[int, typer.Option(help="seed for keys, bytes and picks")] = 0,
    json_out: Annotated[Path | None, typer.Option("--json", help="write the result here")] = None,
    quiet: Annotated[bool, typer.Option(help="no progress bar or table")] = False,
    cacert: CaCert = None,
    cert: ClientCert = None,
    key: ClientKey = None,
) -> None:
    """Load-test a gateway: MB/s, req/s, p50/p99 per op; every GET is checked by sha256."""
    if target not in ("kvgate", "webdav"):
        raise typer.BadParameter("kvgate or webdav", param_hint="target")
    if client not in ("aiohttp", "httpx"):
        raise typer.BadParameter("aiohttp or httpx", param_hint="client")
    if distribution not in ("uniform", "zipf"):
        raise typer.BadParameter("uniform or zipf", param_hint="distribution")
    try:
        parse_weights(mix) if mix else parse_phases(phases, count)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    cfg = BenchConfig(
        url=url,
        target=target,  # type: ignore[arg-type]
        client=client,  # type: ignore[arg-type]
        concurrency=concurrency,
        block_size=block_size,
        count=count,
        keys=keys,
        phases=phases,
        mix=mix,
        distribution=distribution,  # type: ignore[arg-type]
        zipf_s=zipf_s,
        lookup_batch=lookup_batch,
        seed=seed,
        meta_tokens=meta_tokens,
        cacert=str(cacert) if cacert else None,
        cert=str(cert) if cert else None,
        key=str(key) if key else None,
    )
    result = _run(run_bench(cfg, progress=not quiet))
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2))
    if not quiet:
        print_result(result)
    if result["errors"] or result["verify_failures"]:
        raise typer.Exit(1)


def _run(coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
    try:
        import uvloop

        return uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        return asyncio.run(coro)  # type: ignore[arg-type]
