"""The history checker's two scenarios against real processes (tests/e2e/history.py has the traffic and the
checks). ``tests/e2e/test_history.py`` runs them short in CI; ``python -m benchmarks.history`` runs them long.

- ``fs``: one gateway on the filesystem and SQLite, killed -9 and restarted (reconcile on) at random points, with
  ``kvgate gc`` running in a loop beside it and ``kvgate import`` of a vLLM fs-tier directory, whose files name some
  of the same keys, now and then;
- ``replicas``: gateways over one SeaweedFS bucket and one PostgreSQL database, one killed -9 at random points and
  started again (reconcile on), while the others serve.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.capacity.helpers import block_files, index_rows
from tests.e2e.history import History, Traffic, Verdict, check, digest_of, final_state, workload_keys
from tests.gateway import REPO, Gateway
from tests.s3_servers import S3TestServer
from tests.services import asyncpg_dsn

SWEEP_UPLOADS = {"KVGATE_STALE_UPLOAD_S": "3", "KVGATE_EVICTION_INTERVAL_S": "0.5"}
"""Uploads that lost a part (a writer killed, or refused for another upload of its key) are dropped within
seconds, so that the next upload of the key can begin."""


@dataclass
class Faults:
    """Kills and restarts gateways at random points until stopped; counts what it did."""

    gateways: list[Gateway]
    rng: random.Random
    every_s: tuple[float, float]
    down: set[int] = field(default_factory=set)
    kills: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def urls(self) -> list[str]:
        return [g.url for i, g in enumerate(self.gateways) if i not in self.down]

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every_s)):
            i = self.rng.randrange(len(self.gateways))
            self.down.add(i)
            self.gateways[i].kill9()
            self.kills += 1
            if self.stop.wait(self.rng.uniform(0.2, 1.0)):
                break
            self.gateways[i].start()  # reconcile on start (the default), beside the others' traffic
            self.down.discard(i)
        for i in sorted(self.down):
            self.gateways[i].start()
        self.down.clear()


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "KVGATE_LOG_LEVEL": "warning", **env},
        capture_output=True,
        timeout=300,
    )


@dataclass
class Tools:
    """``kvgate gc`` in a loop and ``kvgate import`` now and then, beside the gateway, until stopped."""

    data_dir: Path
    source: Path
    history: History
    keys: list[str]
    rng: random.Random
    runs: dict[str, int] = field(default_factory=lambda: {"gc": 0, "import": 0})
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        env = {"KVGATE_DATA_DIR": str(self.data_dir)}
        while not self.stop.is_set():
            if self.rng.random() < 0.25:
                self._import(env)
            else:
                done = _cli("gc", "--json", env=env)
                self.runs["gc"] += 1
                if done.returncode != 0:
                    self.failures.append(f"gc: {done.stderr.decode(errors='replace')[-500:]}")
            self.stop.wait(self.rng.uniform(0.2, 1.0))

    def _import(self, env: dict[str, str]) -> None:
        """vLLM fs-tier files for a few keys, imported (copied, create-only) while the gateway writes them too."""
        chosen = self.rng.sample(self.keys, 4)
        ops = []
        for key in chosen:
            body = self.rng.randbytes(4096)
            path = self.source / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body)
            ops.append(self.history.begin("import", key, digest_of(body)))
        done = _cli("import", str(self.source), env=env)
        for op in ops:
            History.end(op, "unknown")  # per key, the import may or may not have stored it (create-only)
        self.runs["import"] += 1
        if done.returncode not in (0, 1):
            self.failures.append(f"import: {done.stderr.decode(errors='replace')[-500:]}")
        for key in chosen:
            (self.source / key).unlink()


@dataclass
class RunReport:
    verdict: Verdict
    history: History
    kills: int
    tools: dict[str, int]
    seconds: float

    def lines(self) -> list[str]:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.history.statuses.items()))
        return [
            self.verdict.summary(),
            f"faults: {self.kills} kill -9; tools: {self.tools}; {self.seconds:.0f} s",
            f"answers: {statuses}",
            *self.verdict.problems[:20],
        ]


def _traffic(traffic: Traffic, *, workers: int, seconds: float) -> None:
    asyncio.run(traffic.run(workers=workers, seconds=seconds))


def run_fs(root: Path, *, seconds: float, seed: int = 1, workers: int = 6, keys: int = 24) -> RunReport:
    began = time.monotonic()
    history = History()
    root.mkdir(parents=True, exist_ok=True)
    gw = Gateway(root / "data", env=SWEEP_UPLOADS).start()
    names = workload_keys(keys)
    faults = Faults([gw], random.Random(seed + 1), every_s=(2.0, 5.0))
    tools = Tools(root / "data", root / "vllm-fs", history, names, random.Random(seed + 2))
    threads = [threading.Thread(target=faults.run), threading.Thread(target=tools.run)]
    try:
        for t in threads:
            t.start()
        _traffic(Traffic(faults.urls, names, history, seed=seed), workers=workers, seconds=seconds)
    finally:
        faults.stop.set()
        tools.stop.set()
        for t in threads:
            t.join(300)
    assert not tools.failures, tools.failures
    assert _cli("gc", "--json", env={"KVGATE_DATA_DIR": str(gw.data_dir)}).returncode == 0
    try:
        final = final_state(gw.url, names)
        rows = {k: s for k, s in index_rows(gw.data_dir).items() if k in names}
        files = {k: s for k, s in block_files(gw.data_dir).items() if k in names}
        assert rows == files, "index rows and files differ"
        assert set(rows) == {k for k, v in final.items() if v is not None}
        _stats_agree(gw.url, index_rows(gw.data_dir), _sqlite_part_bytes(gw.data_dir))
    finally:
        gw.stop()
    verdict = check(history, final)
    return RunReport(verdict, history, faults.kills, tools.runs, time.monotonic() - began)


def _stats_agree(url: str, rows: dict[str, int], part_bytes: int) -> None:
    """/v1/stats counts the rows, and their bytes with those of the stored parts of incomplete objects."""
    stats: dict[str, Any] = httpx.get(f"{url}/v1/stats", timeout=10).json()
    expected = (len(rows), sum(rows.values()) + part_bytes)
    assert (stats["blocks"], stats["usage_bytes"]) == expected, (stats, expected)


def _sqlite_part_bytes(data_dir: Path) -> int:
    with sqlite3.connect(data_dir / "index.db") as conn:
        return int(conn.execute('SELECT COALESCE(SUM("end" - start), 0) FROM parts').fetchone()[0])


def run_replicas(
    root: Path,
    *,
    env: dict[str, str],
    truth: SharedTruth,
    seconds: float,
    seed: int = 1,
    replicas: int = 2,
    workers: int = 6,
    keys: int = 24,
) -> RunReport:
    """Replicas with ``env`` over the index and bucket that ``truth`` reads behind their backs."""
    began = time.monotonic()
    history = History()
    root.mkdir(parents=True, exist_ok=True)
    gateways = [Gateway(root / f"g{i}", env={**env, **SWEEP_UPLOADS}) for i in range(replicas)]
    for g in gateways:
        g.start()
    names = workload_keys(keys)
    faults = Faults(gateways, random.Random(seed + 1), every_s=(2.0, 5.0))
    thread = threading.Thread(target=faults.run)
    try:
        thread.start()
        _traffic(Traffic(faults.urls, names, history, seed=seed), workers=workers, seconds=seconds)
    finally:
        faults.stop.set()
        thread.join(300)
    try:
        finals = [final_state(g.url, names) for g in gateways]
        assert all(f == finals[0] for f in finals), "replicas answer differently"
        rows = truth.rows()
        assert {k for k in rows if k in names} == {k for k, v in finals[0].items() if v is not None}
        missing = [k for k, (size, stamp) in rows.items() if not truth.has_object(k, stamp, size)]
        assert not missing, f"rows without their object: {missing[:5]}"
        for g in gateways:
            _stats_agree(g.url, {k: size for k, (size, _) in rows.items()}, truth.part_bytes())
    finally:
        for g in gateways:
            g.stop()
    verdict = check(history, finals[0])
    return RunReport(verdict, history, faults.kills, {}, time.monotonic() - began)


@dataclass(frozen=True)
class SharedTruth:
    """What the replicas' shared index and bucket hold, read behind the gateways' backs (PostgreSQL, S3)."""

    db_url: str
    s3: S3TestServer
    bucket: str
    prefix: str

    def _sql(self, statement: str) -> list[Any]:
        async def q() -> list[Any]:
            import asyncpg  # type: ignore[import-untyped]

            conn = await asyncpg.connect(asyncpg_dsn(self.db_url))
            try:
                return list(await conn.fetch(statement))
            finally:
                await conn.close()

        return asyncio.run(q())

    def rows(self) -> dict[str, tuple[int, str | None]]:
        return {r["key"]: (r["size"], r["stamp"]) for r in self._sql("SELECT key, size, stamp FROM blocks")}

    def part_bytes(self) -> int:
        return int(self._sql('SELECT COALESCE(SUM("end" - start), 0) AS n FROM parts')[0]["n"])

    def has_object(self, key: str, stamp: str | None, size: int) -> bool:
        async def q() -> bool:
            name = f"{self.prefix}/{key}" + ("" if stamp is None else f".v{stamp}")
            async with self.s3.client() as s3:
                try:
                    head = await s3.head_object(Bucket=self.bucket, Key=name)
                except Exception:
                    return False
                return int(head["ContentLength"]) == size

        return asyncio.run(q())
