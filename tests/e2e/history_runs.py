"""The history checker's two scenarios against real processes (tests/e2e/history.py has the traffic and the
checks). ``tests/e2e/test_history.py`` runs them short in CI; ``python -m tests.e2e.run_history`` runs them long.

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
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loopback.s3_servers import S3TestServer
from tests.capacity.helpers import block_files, index_rows
from tests.e2e.faults.sitecustomize import CRASH_POINTS
from tests.e2e.history import History, Traffic, Verdict, check, digest_of, final_state, workload_keys
from tests.e2e.nemesis import KINDS, Clocks, PgFaults, Rot, S3Faults, S3Rot
from tests.gateway import REPO, Gateway
from tests.pg_proxy import PgFaultProxy
from tests.services import asyncpg_dsn
from tests.tcp_faults import TcpFaultProxy

FAULTS = REPO / "tests" / "e2e" / "faults"

SWEEP_UPLOADS = {"KVGATE_STALE_UPLOAD_S": "3", "KVGATE_EVICTION_INTERVAL_S": "0.5"}
"""Uploads that lost a part (a writer killed, or refused for another upload of its key) are dropped within
seconds, so that the next upload of the key can begin."""


@dataclass
class Faults:
    """Kills and restarts gateways at random points until stopped; counts what it did."""

    gateways: list[Gateway]
    rng: random.Random
    every_s: tuple[float, float]
    clocks: Clocks | None = None
    """Each start gets a clock of its own (the ``clock`` nemesis)."""
    coord: Path | None = None
    """The coordination file to remove now and then (the ``coord`` nemesis)."""
    coord_losses: int = 0
    worker_kills: int = 0
    """Kills of one worker of a ``--workers`` gateway (half the kills when it has several)."""
    failures: list[str] = field(default_factory=list)
    points: Path | None = None
    """The flags folder of the crash points (``CRASH_POINTS``, tests/e2e/faults/sitecustomize.py): each gateway start
    draws one point of the table; half the kills are aimed there instead (the point armed, the gateway kills itself
    when it reaches it, at start-up reconcile too), each counted by name in ``point_counts``."""
    point_counts: Counter[str] = field(default_factory=Counter)
    down: set[int] = field(default_factory=set)
    kills: int = 0
    point_kills: int = 0
    failed_starts: int = 0
    """Starts that failed (the index out of reach through the PostgreSQL nemesis: the gateway exits 3), retried as a
    supervisor would."""
    stop: threading.Event = field(default_factory=threading.Event)

    def urls(self) -> list[str]:
        return [g.url for i, g in enumerate(self.gateways) if i not in self.down]

    def run(self) -> None:
        while not self.stop.wait(self.rng.uniform(*self.every_s)):
            i = self.rng.randrange(len(self.gateways))
            if self.coord is not None and self.rng.random() < 0.25:
                self._lose_coordination(i, self.coord)
                continue
            gw = self.gateways[i]
            if gw.workers > 1 and self.rng.random() < 0.5:
                pids = gw.worker_pids()
                if pids:
                    os.kill(self.rng.choice(pids), signal.SIGKILL)  # the supervisor starts another
                    self.worker_kills += 1
                continue
            if self.points is not None and self.rng.random() < 0.5:
                self._at_point(self.points)
            self.down.add(i)
            self.gateways[i].kill9()
            self.kills += 1
            if self.stop.wait(self.rng.uniform(0.2, 1.0)):
                break
            self._start(i)  # reconcile on start (the default), beside the others' traffic
            self.down.discard(i)
        for i in sorted(self.down):
            self._start(i)
        self.down.clear()

    def _lose_coordination(self, i: int, coord: Path, *, notice_s: float = 30.0) -> None:
        """Remove the coordination file under the running gateway (and any tool), traffic still flowing: the
        gateway must stop by itself (it refuses changes and restarts); it is then started again."""
        gw = self.gateways[i]
        try:
            coord.unlink()
        except FileNotFoundError:
            return
        self.coord_losses += 1
        assert gw.proc is not None
        if gw.workers > 1:  # each worker stops by itself and the supervisor starts another, on the new file
            deadline = time.monotonic() + notice_s
            while _holding_removed(gw.worker_pids(), coord) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _holding_removed(gw.worker_pids(), coord):
                self.failures.append(f"a worker went on for {notice_s:.0f} s without its coordination file")
            return
        try:
            gw.proc.wait(notice_s)
        except subprocess.TimeoutExpired:
            self.failures.append(f"the gateway went on for {notice_s:.0f} s without its coordination file")
        self.down.add(i)
        gw.kill9()  # a stop: nothing is left of it (it exited on its own)
        self._start(i)
        self.down.discard(i)

    def _at_point(self, points: Path) -> None:
        """Arm the gateway's point and wait a few seconds for the traffic to reach it (the gateway, or one of its
        workers, kills itself there); left armed for the next start-up if it was not reached."""
        (points / "arm").touch()
        deadline = time.monotonic() + 4.0
        while not (points / "fired").exists() and time.monotonic() < deadline and not self.stop.wait(0.05):
            pass
        self._fired(points)

    def _fired(self, points: Path) -> bool:
        """Count the point a process died at, if one did."""
        fired = points / "fired"
        try:
            point = fired.read_text()
        except FileNotFoundError:
            return False
        fired.unlink()
        self.point_kills += 1
        self.point_counts[f"crash point {point}"] += 1
        return True

    def _start(self, i: int, *, tries: int = 10) -> None:
        """Start gateway ``i`` again, with a new point drawn; a point left armed stays so through its start-up
        reconcile (a start that dies there is tried again), then is disarmed."""
        gw = self.gateways[i]
        if self.clocks is not None:
            gw.extra_env |= self.clocks.env()
        if self.points is not None:
            gw.extra_env |= crash_env(self.rng, self.points)
        try:
            for _ in range(tries - 1):
                try:
                    gw.start()
                    return
                except RuntimeError:
                    if self.points is None or not self._fired(self.points):  # else it died at its point
                        self.failed_starts += 1
                    time.sleep(0.5)
            gw.start()
        finally:
            if self.points is not None:
                (self.points / "arm").unlink(missing_ok=True)
                self._fired(self.points)


def crash_env(rng: random.Random, points: Path) -> dict[str, str]:
    """The environment of a gateway that kills itself at one point of the table, drawn at random, the first time
    the point is reached while ``points/arm`` exists (tests/e2e/faults/sitecustomize.py)."""
    point = rng.choice(sorted(CRASH_POINTS))
    return {
        "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}",
        "KVGATE_TEST_CRASH": f"{point}:1",
        "KVGATE_TEST_CRASH_DIR": str(points),
    }


def _holding_removed(pids: list[int], path: Path) -> bool:
    """Whether one of ``pids`` still has the file removed from ``path`` open (its descriptor's link says so)."""
    removed = f"{path} (deleted)"
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == removed:
                    return True
            except OSError:
                continue
    return False


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
    kill_gc: bool = False
    """Now and then a ``kvgate gc`` or ``kvgate import`` run is killed -9 at a random point (counted in
    ``runs["gc kill -9"]`` and ``runs["import kill -9"]``)."""
    clocks: Clocks | None = None
    runs: Counter[str] = field(default_factory=lambda: Counter({"gc": 0, "import": 0}))
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            env = {"KVGATE_DATA_DIR": str(self.data_dir)} | (self.clocks.env() if self.clocks is not None else {})
            if self.rng.random() < 0.25:
                self._import(env)
            else:
                self._tool("gc", ["gc", "--json"], env=env, ok=(0,))
            self.stop.wait(self.rng.uniform(0.2, 1.0))

    def _tool(self, name: str, args: list[str], *, env: dict[str, str], ok: tuple[int, ...]) -> None:
        """One run of ``kvgate <args>``, killed -9 at a random point half the time when ``kill_gc``."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "KVGATE_LOG_LEVEL": "warning", **env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        self.runs[name] += 1
        if self.kill_gc and self.rng.random() < 0.5:
            try:
                proc.wait(self.rng.uniform(0.5, 5.0))  # start-up takes seconds here: the kill lands anywhere
            except subprocess.TimeoutExpired:
                proc.kill()
                self.runs[f"{name} kill -9"] += 1
        _, err = proc.communicate(timeout=300)
        if proc.returncode not in (*ok, -9):
            if b"CoordinationLost" in err or b"was removed or replaced" in err:
                self.runs[f"{name} refused: coordination file removed"] += 1  # it noticed and stopped: right
            else:
                self.failures.append(f"{name}: {err.decode(errors='replace')[-500:]}")

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
        self._tool("import", ["import", str(self.source)], env=env, ok=(0, 1))
        for op in ops:
            History.end(op, "unknown")  # per key, the import may or may not have stored it (create-only)
        for key in chosen:
            (self.source / key).unlink()


@dataclass
class RunReport:
    verdict: Verdict
    history: History
    kills: int
    tools: dict[str, int]
    seconds: float
    faults: Counter[str] = field(default_factory=Counter)
    """Faults injected, by kind (the gateway kills, ``kvgate gc`` kills, bit rot, PostgreSQL's)."""

    @property
    def total_faults(self) -> int:
        """Faults injected, all kinds: the crash points named one by one are a breakdown of their total, and a
        start that failed (retried) is an effect, not a fault."""
        return sum(
            n
            for kind, n in self.faults.items()
            if not kind.startswith("crash point ") and kind != "gateway start failed, retried"
        )

    def lines(self) -> list[str]:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(self.history.statuses.items()))
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())) or "none"
        return [
            self.verdict.summary(),
            f"faults injected: {self.total_faults} in all: {faults}; corrupted keys {len(self.history.corrupted)}",
            f"tools: {self.tools}; {self.seconds:.0f} s",
            f"answers: {statuses}",
            *self.verdict.problems[:20],
        ]


def _traffic(traffic: Traffic, *, workers: int, seconds: float) -> None:
    asyncio.run(traffic.run(workers=workers, seconds=seconds))


def run_fs(
    root: Path,
    *,
    seconds: float,
    seed: int = 1,
    workers: int = 6,
    keys: int = 24,
    nemesis: frozenset[str] = frozenset(KINDS),
    intensity: float = 1.0,
) -> RunReport:
    """One filesystem gateway; ``nemesis`` picks the fault kinds (``tests/e2e/nemesis.py``; ``pg`` has none here);
    ``intensity`` divides the waits between the cheap faults (bit rot; PostgreSQL's and S3's bursts)."""
    began = time.monotonic()
    history = History()
    counts: Counter[str] = Counter()
    root.mkdir(parents=True, exist_ok=True)
    env = dict(SWEEP_UPLOADS)
    points = None
    if "points" in nemesis:
        points = root / "points"
        points.mkdir(exist_ok=True)
        env |= crash_env(random.Random(seed + 6), points)
    clocks = Clocks(random.Random(seed + 5), counts) if "clock" in nemesis else None
    processes = 2 if "workers" in nemesis else 1
    gw = Gateway(root / "data", env=env | (clocks.env() if clocks is not None else {}), workers=processes).start()
    names = workload_keys(keys)
    every = (2.0, 5.0) if "kill9" in nemesis else (1e9, 1e9)
    coord = gw.data_dir / "kvgate.coord" if "coord" in nemesis else None
    faults = Faults([gw], random.Random(seed + 1), every_s=every, clocks=clocks, coord=coord, points=points)
    tools = Tools(
        root / "data", root / "vllm-fs", history, names, random.Random(seed + 2), kill_gc="gc" in nemesis, clocks=clocks
    )
    rot = Rot(root / "data" / "blocks", history, random.Random(seed + 3), counts, intensity=intensity)
    threads = [threading.Thread(target=faults.run), threading.Thread(target=tools.run)]
    if "rot" in nemesis:
        threads.append(threading.Thread(target=rot.run))
    try:
        for t in threads:
            t.start()
        _traffic(Traffic(faults.urls, names, history, seed=seed), workers=workers, seconds=seconds)
    finally:
        faults.stop.set()
        tools.stop.set()
        rot.stop.set()
        for t in threads:
            t.join(300)
    counts["gateway kill -9"] = faults.kills
    counts["gateway crash at a named point (all points)"] = faults.point_kills
    counts.update(faults.point_counts)
    counts["gc kill -9"] = tools.runs["gc kill -9"]
    counts["import kill -9"] = tools.runs["import kill -9"]
    counts["coordination file removed under the gateway and tools"] = faults.coord_losses
    counts["one worker of two killed -9"] = faults.worker_kills
    assert not tools.failures, tools.failures
    assert not faults.failures, faults.failures
    env = {"KVGATE_DATA_DIR": str(gw.data_dir)}
    assert _cli("gc", "--json", env=env).returncode == 0
    scrub = _cli("scrub", "--json", env=env)  # the corrupt blocks quarantined: a miss from now on
    assert scrub.returncode == 0, scrub.stderr.decode(errors="replace")[-500:]
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
    kills = faults.kills + faults.worker_kills
    return RunReport(verdict, history, kills, tools.runs, time.monotonic() - began, counts)


def _stats_agree(url: str, rows: dict[str, int], part_bytes: int, *, settle_s: float = 15.0) -> None:
    """/v1/stats counts the rows, and their bytes with those of the stored parts of incomplete objects (once a
    change made behind the gateway's back, the final scrub's, has reached its usage refresh)."""
    expected = (len(rows), sum(rows.values()) + part_bytes)
    deadline = time.monotonic() + settle_s
    while True:
        stats: dict[str, Any] = httpx.get(f"{url}/v1/stats", timeout=10).json()
        if (stats["blocks"], stats["usage_bytes"]) == expected or time.monotonic() > deadline:
            break
        time.sleep(0.25)
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
    nemesis: frozenset[str] = frozenset(KINDS),
    intensity: float = 1.0,
) -> RunReport:
    """Replicas with ``env`` over the index and bucket that ``truth`` reads behind their backs; with ``pg`` and
    ``s3`` in ``nemesis`` they reach PostgreSQL and S3 through fault proxies (``tests/e2e/nemesis.py``)."""
    began = time.monotonic()
    history = History()
    counts: Counter[str] = Counter()
    root.mkdir(parents=True, exist_ok=True)
    direct = dict(env)  # a tool's: straight to PostgreSQL and S3
    proxy = None
    if "pg" in nemesis:
        upstream = int(truth.db_url.rsplit(":", 1)[1].split("/", 1)[0])
        proxy = PgFaultProxy(upstream_port=upstream, seed=seed).start()
        env = {**env, "KVGATE_DB_URL": proxy.url_for(truth.db_url)}
    s3_proxy = None
    if "s3" in nemesis:
        s3_proxy = TcpFaultProxy(upstream_port=truth.s3.port, seed=seed + 6).start()
        env = {**env, "KVGATE_BACKEND__ENDPOINT_URL": s3_proxy.url}
    # within S3's 15-minute signing window: a host further off has every S3 request refused (403), a fault of its
    # set-up that no protocol can mend, not a race between clocks
    clocks = Clocks(random.Random(seed + 5), counts, offset_s=10 * 60) if "clock" in nemesis else None
    gateways = [Gateway(root / f"g{i}", env={**env, **SWEEP_UPLOADS}) for i in range(replicas)]
    for g in gateways:
        g.extra_env |= clocks.env() if clocks is not None else {}
        g.start()
    names = workload_keys(keys)
    every = (2.0, 5.0) if "kill9" in nemesis else (1e9, 1e9)
    faults = Faults(gateways, random.Random(seed + 1), every_s=every, clocks=clocks)
    threads = [threading.Thread(target=faults.run)]
    pg = None if proxy is None else PgFaults(proxy, random.Random(seed + 4), counts, intensity=intensity)
    if pg is not None:
        threads.append(threading.Thread(target=pg.run))
    s3 = None if s3_proxy is None else S3Faults(s3_proxy, random.Random(seed + 7), counts, intensity=intensity)
    if s3 is not None:
        threads.append(threading.Thread(target=s3.run))
    rot = S3Rot(truth.s3, truth.bucket, truth.prefix, history, random.Random(seed + 8), counts, intensity=intensity)
    if "rot" in nemesis:
        threads.append(threading.Thread(target=rot.run))
    try:
        for t in threads:
            t.start()
        _traffic(Traffic(faults.urls, names, history, seed=seed), workers=workers, seconds=seconds)
    finally:
        faults.stop.set()
        if pg is not None:
            pg.stop.set()
        if s3 is not None:
            s3.stop.set()
        rot.stop.set()
        for t in threads:
            t.join(300)
    counts["gateway kill -9"] = faults.kills
    counts["gateway start failed, retried"] = faults.failed_starts
    scrub = _cli("scrub", "--json", env=direct)  # the corrupt objects removed with their rows: a miss from now on
    assert scrub.returncode == 0, scrub.stderr.decode(errors="replace")[-500:]
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
        if proxy is not None:
            proxy.stop()
        if s3_proxy is not None:
            s3_proxy.stop()
    verdict = check(history, finals[0])
    return RunReport(verdict, history, faults.kills, {}, time.monotonic() - began, counts)


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
