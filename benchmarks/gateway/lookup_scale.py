"""Lookup and HEAD at index scale: POST /v1/lookup of 1,000 keys against a 1,000,000-row SQLite index.

    .venv/bin/python -m benchmarks.gateway.lookup_scale                # 1M rows, baseline 10k rows
    .venv/bin/python -m benchmarks.gateway.lookup_scale --rows 200000  # quicker
    .venv/bin/python -m benchmarks.gateway.lookup_scale --pg           # the same on PostgreSQL (Debian's postgresql)

The index is filled behind the gateway's back (alembic schema, then executemany in big transactions), the
gateway is started on it with KVGATE_RECONCILE_ON_START=false (the rows have no data files: a reconcile would drop
them all, which is right for a real data dir but not what is measured here). Figures are printed with a baseline
from the same run: the same calls against a small index, a 1-key lookup, and /healthz at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from app.index.migrate import upgrade_head
from benchmarks.harness import NAMESPACE, key_for
from loopback.gateway import Gateway


def fill_index(data_dir: Path, rows: int, *, batch: int = 100_000) -> float:
    """Create the schema with alembic, insert ``rows`` block rows; seconds taken by the inserts."""
    data_dir.mkdir(parents=True, exist_ok=True)
    db = data_dir / "index.db"
    asyncio.run(upgrade_head(f"sqlite+aiosqlite:///{db.resolve()}"))
    began = time.perf_counter()
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=OFF")
    conn.execute("PRAGMA cache_size=-262144")  # 256 MiB: the B-trees of 1M random keys stay in memory
    now = time.time()
    digest = "0" * 64
    sql = (
        "INSERT INTO blocks (key, namespace, rank, grp, size, digest, created_at, last_access, hits)"
        " VALUES (?, ?, 0, 0, 4096, ?, ?, ?, 0)"
    )
    # Keys in sorted order: the primary-key B-tree is then built by appends, not random page splits.
    keys = sorted(key_for(i) for i in range(rows))
    for start in range(0, rows, batch):
        chunk = keys[start : start + batch]
        with conn:
            conn.executemany(sql, ((k, NAMESPACE, digest, now + (start + j) * 1e-6, now) for j, k in enumerate(chunk)))
    conn.close()
    return time.perf_counter() - began


async def fill_pg(url: str, rows: int) -> float:
    """The schema by alembic, then ``rows`` block rows by COPY; seconds taken by the copy."""
    import asyncpg  # type: ignore[import-untyped]

    from loopback.postgres import asyncpg_dsn

    await upgrade_head(url)
    began = time.perf_counter()
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        now = time.time()
        records = [
            (k, NAMESPACE, 0, 0, 4096, "0" * 64, now + j * 1e-6, now, 0)
            for j, k in enumerate(map(key_for, range(rows)))
        ]
        cols = ["key", "namespace", "rank", "grp", "size", "digest", "created_at", "last_access", "hits"]
        await conn.copy_records_to_table("blocks", records=records, columns=cols)
        await conn.execute("ANALYZE blocks")
    finally:
        await conn.close()
    return time.perf_counter() - began


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def time_lookups(url: str, rows: int, *, n_keys: int, calls: int, seed: int) -> list[float]:
    """Seconds per POST /v1/lookup of ``n_keys`` keys: a present prefix of random length, then misses."""
    rng = random.Random(seed)
    out: list[float] = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(calls):
            first = rng.randrange(0, rows - n_keys)
            hits = rng.randrange(0, n_keys + 1)
            misses = [key_for(rows + 10 * first + j) for j in range(n_keys - hits)]
            keys = [key_for(first + j) for j in range(hits)] + misses
            began = time.perf_counter()
            r = c.post("/v1/lookup", json={"keys": keys})
            out.append(time.perf_counter() - began)
            if r.status_code != 200 or r.json()["prefix"] != hits:
                raise SystemExit(f"lookup wrong: {r.status_code} {r.text[:200]}")
    return out


async def rate(url: str, paths: list[str], *, method: str, concurrency: int, expect: int) -> float:
    """Requests per second over ``paths`` at ``concurrency`` (aiohttp: a light client on a 2-core machine)."""
    queue = list(reversed(paths))
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=connector) as s:

        async def worker() -> None:
            while queue:
                path = queue.pop()
                async with s.request(method, path) as r:
                    await r.read()
                    if r.status != expect:
                        raise SystemExit(f"{method} {path}: {r.status}")

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(paths) / (time.perf_counter() - began)


def measure(rows: int, *, calls: int, heads: int, concurrency: int, workdir: Path, pg: Any = None) -> dict[str, float]:
    data_dir = workdir / f"rows-{rows}"
    env = {"KVGATE_RECONCILE_ON_START": "false", "KVGATE_LOG_LEVEL": "warning"}
    if pg is None:
        fill_s = fill_index(data_dir, rows)
    else:
        url = asyncio.run(pg.create_database())
        fill_s = asyncio.run(fill_pg(url, rows))
        env["KVGATE_DB_URL"] = url
    gw = Gateway(data_dir, env=env)
    began = time.perf_counter()
    gw.start(timeout_s=300)
    start_s = time.perf_counter() - began
    try:
        stats = httpx.get(f"{gw.url}/v1/stats").json()
        if stats["blocks"] != rows:
            raise SystemExit(f"gateway sees {stats['blocks']} blocks, expected {rows}")
        time_lookups(gw.url, rows, n_keys=1000, calls=5, seed=0)  # warm-up
        big = time_lookups(gw.url, rows, n_keys=1000, calls=calls, seed=1)
        one = time_lookups(gw.url, rows, n_keys=1, calls=calls, seed=2)
        rng = random.Random(3)
        sample = [f"/v1/blocks/{key_for(rng.randrange(rows))}" for _ in range(heads)]
        cold = asyncio.run(rate(gw.url, sample, method="HEAD", concurrency=concurrency, expect=200))
        warm = asyncio.run(rate(gw.url, sample, method="HEAD", concurrency=concurrency, expect=200))
        health = asyncio.run(rate(gw.url, ["/healthz"] * heads, method="GET", concurrency=concurrency, expect=200))
    finally:
        gw.stop()
    return {
        "fill_s": fill_s,
        "start_s": start_s,
        "lookup1000_p50_ms": statistics.median(big) * 1e3,
        "lookup1000_p99_ms": pct(big, 0.99) * 1e3,
        "lookup1_p50_ms": statistics.median(one) * 1e3,
        "head_cold_rps": cold,
        "head_warm_rps": warm,
        "healthz_rps": health,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--baseline-rows", type=int, default=10_000)
    ap.add_argument("--calls", type=int, default=200, help="lookups timed per size")
    ap.add_argument("--heads", type=int, default=5000, help="HEADs per rate measurement")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--pg", action="store_true", help="index on a throwaway local PostgreSQL instead of SQLite")
    args = ap.parse_args()
    local = None
    pg = None
    if args.pg:
        from loopback.postgres import LocalPostgres, pg_bindir

        bindir = pg_bindir()
        if bindir is None:
            raise SystemExit("no PostgreSQL binaries: apt-get install -y postgresql")
        local = LocalPostgres(bindir)
        pg = local.start()
    try:
        with tempfile.TemporaryDirectory(prefix="kvgate-lookup-") as tmp:
            results = {
                n: measure(
                    n, calls=args.calls, heads=args.heads, concurrency=args.concurrency, workdir=Path(tmp), pg=pg
                )
                for n in (args.baseline_rows, args.rows)
            }
    finally:
        if local is not None:
            local.stop()
    base, big = results[args.baseline_rows], results[args.rows]
    print(
        f"\nkvgate lookup/HEAD at index scale ({'PostgreSQL' if args.pg else 'SQLite'}, {args.calls} lookups, "
        f"{args.heads} HEADs, c={args.concurrency})"
    )
    print(f"{'metric':<22}{args.baseline_rows:>14,} rows{args.rows:>14,} rows{'ratio':>9}")
    for name in base:
        ratio = big[name] / base[name] if base[name] else float("nan")
        print(f"{name:<22}{base[name]:>19.2f}{big[name]:>19.2f}{ratio:>9.2f}")


if __name__ == "__main__":
    main()
