"""Every named crash point, against real processes (issue 41, the nemesis's table).

For each row of ``TABLE`` a process (a gateway, or ``kvgate scrub``) runs with the test-only crash hook
(tests/e2e/faults/sitecustomize.py, ``KVGATE_TEST_CRASH``) and kills itself (SIGKILL) right after the named step
of the row's operation; a gateway is started again on the data directory (its start-up reconcile on), and then:

- the key holds its old acknowledged value or the new one, never another (a removal: the old value or a miss; a
  corrupt block: a miss), and GET, HEAD and lookup agree, each body under its own ETag;
- the index's rows and the published block files name the same keys, and no staged file is left;
- a multi-part object can be sent again and completes.

A point that its operation never reaches fails its row (the process must die there, and say which point), and the
table must name every point of the hook, so that neither can rot unseen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.capacity.helpers import block_files, index_rows
from tests.conftest import TEST_NS, key_for, random_bytes
from tests.e2e.faults.sitecustomize import CRASH_POINTS
from tests.e2e.history import digest_of, final_state
from tests.gateway import REPO, Gateway

BLOCK = 64 * 1024
FAULTS = Path(__file__).parent / "faults"
OLD, NEW = random_bytes(BLOCK, 1), random_bytes(BLOCK, 2)  # NEW: what tests/e2e/crash_writer.py writes (seed 2)
HALF = BLOCK // 2

pytestmark = pytest.mark.timeout(600)


@dataclass
class Run:
    """One row's run: the gateway, its key, its flags folder (``arm``, ``fired``), its point."""

    gw: Gateway
    key: str
    flags: Path

    point: str

    @property
    def blocks(self) -> Path:
        return self.gw.data_dir / "blocks"

    def arm(self) -> None:
        """From now on the process dies at the first call of the row's point."""
        (self.flags / "arm").write_text(self.point)


def _crash_env(flags: Path) -> dict[str, str]:
    """Every point wrapped; none armed until ``flags/arm`` names one."""
    return {
        "PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}",
        "KVGATE_TEST_CRASH": "all:1",
        "KVGATE_TEST_CRASH_DIR": str(flags),
    }


def _quietly(call: Callable[[], httpx.Response]) -> httpx.Response | None:
    """The answer, or None if the process died under the request."""
    try:
        return call()
    except httpx.TransportError:
        return None


def _put(c: httpx.Client, key: str, body: bytes, **headers: str) -> httpx.Response | None:
    return _quietly(lambda: c.put(f"/v1/blocks/{key}", content=body, headers=headers))


def _part(c: httpx.Client, key: str, start: int, end: int) -> httpx.Response | None:
    body = NEW[start:end]
    return _put(c, key, body, **{"Content-Range": f"bytes {start}-{end - 1}/{BLOCK}"})


def _stored(c: httpx.Client, key: str, body: bytes) -> None:
    got = c.put(f"/v1/blocks/{key}", content=body)
    assert got.status_code in (200, 201), got.text


def _spawn_crash_writer(run: Run, *, commit: bool) -> None:
    """A writer that stages NEW for the key and is killed: after its row commit (``commit``), or before it."""
    flags = Path(tempfile.mkdtemp(prefix="writer-", dir=run.flags))
    writer = subprocess.Popen(
        [
            sys.executable,
            *("-m", "tests.e2e.crash_writer", "--root", str(run.blocks)),
            *("--db", str(run.gw.data_dir / "index.db"), "--key", run.key, "--seed", "2", "--flags", str(flags)),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _until(lambda: (flags / "staged").exists(), writer)
        if commit:
            (flags / "commit").touch()
            _until(lambda: (flags / "committed").exists(), writer)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(10)


def _until(done: Callable[[], bool], proc: subprocess.Popen[bytes], *, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.02)


# -- the operations: each crashes the armed process at the row's point; the values the key may then hold --------

Values = set[bytes | None]


def op_put(run: Run, c: httpx.Client) -> Values:
    _stored(c, run.key, OLD)
    run.arm()
    _put(c, run.key, NEW)
    return {OLD, NEW}


def op_create(run: Run, c: httpx.Client) -> Values:
    run.arm()
    _put(c, run.key, NEW, **{"If-None-Match": "*"})
    return {None, NEW}


def op_same(run: Run, c: httpx.Client) -> Values:
    """A PUT of the bytes already stored: the staged copy is dropped, nothing written."""
    _stored(c, run.key, OLD)
    run.arm()
    _put(c, run.key, OLD)
    return {OLD}


def op_part(run: Run, c: httpx.Client) -> Values:
    """The first part of an object of two."""
    run.arm()
    _part(c, run.key, 0, HALF)
    return {None}


def op_complete(run: Run, c: httpx.Client) -> Values:
    """The part that completes an object of two."""
    got = _part(c, run.key, HALF, BLOCK)
    assert got is not None and got.status_code < 300, got
    run.arm()
    _part(c, run.key, 0, HALF)
    return {None, NEW}


def op_delete(run: Run, c: httpx.Client) -> Values:
    _stored(c, run.key, OLD)
    run.arm()
    _quietly(lambda: c.delete(f"/v1/blocks/{run.key}"))
    return {None, OLD}


def op_purge(run: Run, c: httpx.Client) -> Values:
    _stored(c, run.key, OLD)
    run.arm()
    _quietly(lambda: c.delete(f"/v1/namespaces/{TEST_NS}"))
    return {None, OLD}


def op_evict(run: Run, c: httpx.Client) -> Values:
    """The key is the least recently used when the bound is passed (the gateway runs with ``ENV["evict"]``)."""
    _stored(c, run.key, OLD)
    run.arm()
    for i in range(2, 12):  # until the background eviction crashes the gateway
        if _put(c, key_for(i), random_bytes(BLOCK, i)) is None or run.gw.proc is None or run.gw.proc.poll() is not None:
            break
        time.sleep(0.2)
    return {None, OLD}


def op_repair(run: Run, c: httpx.Client) -> Values:
    """A writer committed NEW's row and died before its rename; a GET finds the older file and repairs the key
    (rolls the committed version forward)."""
    _stored(c, run.key, OLD)
    _spawn_crash_writer(run, commit=True)
    run.arm()
    _quietly(lambda: c.get(f"/v1/blocks/{run.key}"))
    return {NEW}


def _at_start(run: Run) -> None:
    """Restart the gateway armed: its start-up reconcile is the operation (the start fails: the process died)."""
    run.gw.stop()
    run.arm()
    with pytest.raises(RuntimeError, match="exited with -9"):
        run.gw.start()


def op_reconcile_roll(run: Run, c: httpx.Client) -> Values:
    """A writer committed NEW's row and died before its rename; start-up reconcile rolls it forward."""
    _stored(c, run.key, OLD)
    _spawn_crash_writer(run, commit=True)
    _at_start(run)
    return {NEW}


def op_reconcile_sweep(run: Run, c: httpx.Client) -> Values:
    """A writer staged NEW and died before its commit; start-up reconcile removes the staged file."""
    _stored(c, run.key, OLD)
    _spawn_crash_writer(run, commit=False)
    _at_start(run)
    return {OLD}


def op_reconcile_adopt(run: Run, c: httpx.Client) -> Values:
    """A block file without a row (vLLM's fs tier wrote it); start-up reconcile adopts it."""
    path = run.blocks / run.key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(NEW)
    _at_start(run)
    return {None, NEW}


def op_reconcile_restamp(run: Run, c: httpx.Client) -> Values:
    """The stored file touched behind the gateway's back (its stamp's mtime no longer the row's, its bytes still
    the row's); start-up reconcile repairs the key: the bytes kept, under a stamp of ours."""
    _stored(c, run.key, OLD)
    run.gw.stop()
    path = run.blocks / run.key
    os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns + 5_000_000_000))
    _at_start(run)
    return {OLD}


def op_reconcile_drop(run: Run, c: httpx.Client) -> Values:
    """The stored file removed behind the gateway's back; start-up reconcile drops the row that names it."""
    _stored(c, run.key, OLD)
    run.gw.stop()
    (run.blocks / run.key).unlink()
    _at_start(run)
    return {None}


def op_scrub(run: Run, c: httpx.Client) -> Values:
    """A bit of the stored block flipped; ``kvgate scrub`` condemns it (quarantine, then the row)."""
    _stored(c, run.key, OLD)
    run.gw.stop()
    with (run.blocks / run.key).open("r+b") as f:
        f.seek(HALF)
        byte = f.read(1)[0]
        f.seek(HALF)
        f.write(bytes([byte ^ 0x10]))
    run.arm()
    scrub = subprocess.run(
        [sys.executable, "-m", "app", "scrub", "--json"],
        cwd=REPO,
        env={**os.environ, **run.gw.extra_env, "KVGATE_DATA_DIR": str(run.gw.data_dir)},
        capture_output=True,
        timeout=120,
    )
    assert scrub.returncode == -signal.SIGKILL, scrub.stderr.decode(errors="replace")[-2000:]
    return {None}


ENV = {
    "evict": {"KVGATE_MAX_BYTES": str(3 * BLOCK), "KVGATE_EVICTION_INTERVAL_S": "0.1"},
    "repair": {"KVGATE_META_CACHE_ENTRIES": "0"},  # the crash writer's row is read, not the PUT's cached one
    "purge": {},  # the namespace of every other row's key
}

Operation = Callable[[Run, httpx.Client], Values]

TABLE: list[tuple[str, Operation, str]] = [
    ("put", op_put, "staged"),
    ("put", op_put, "swapped"),
    ("put", op_put, "published"),
    ("create", op_create, "staged"),
    ("create", op_create, "swapped"),
    ("create", op_create, "published"),
    ("same", op_same, "discarded"),
    ("part", op_part, "part-staged"),
    ("part", op_part, "part-placed"),
    ("part", op_part, "part-recorded"),
    ("complete", op_complete, "part-staged"),
    ("complete", op_complete, "part-placed"),
    ("complete", op_complete, "part-recorded"),
    ("complete", op_complete, "upload-staged"),
    ("complete", op_complete, "swapped"),
    ("complete", op_complete, "published"),
    ("complete", op_complete, "parts-dropped"),
    ("delete", op_delete, "row-removed"),
    ("delete", op_delete, "cleared"),
    ("purge", op_purge, "row-removed"),
    ("purge", op_purge, "cleared"),
    ("evict", op_evict, "row-removed"),
    ("evict", op_evict, "cleared"),
    ("repair", op_repair, "rolled"),
    ("scrub", op_scrub, "quarantined"),
    ("scrub", op_scrub, "row-removed"),
    ("reconcile-roll", op_reconcile_roll, "rolled"),
    ("reconcile-sweep", op_reconcile_sweep, "leftover-dropped"),
    ("reconcile-adopt", op_reconcile_adopt, "claimed"),
    ("reconcile-adopt", op_reconcile_adopt, "swapped"),
    ("reconcile-restamp", op_reconcile_restamp, "claimed"),
    ("reconcile-restamp", op_reconcile_restamp, "swapped"),
    ("reconcile-drop", op_reconcile_drop, "row-removed"),
]


OWN_GATEWAY = frozenset(ENV)
"""Operations whose gateway runs with settings of its own; the others share one gateway (a data directory), each
with a key of its own, restarted after each crash."""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Gateway, Path]]:
    root = tmp_path_factory.mktemp("crash-points")
    flags = root / "flags"
    flags.mkdir()
    gw = Gateway(root / "data", env=_crash_env(flags))
    try:
        yield gw, flags
    finally:
        gw.stop()


def test_the_table_names_every_crash_point() -> None:
    assert {point for _, _, point in TABLE} == set(CRASH_POINTS)


@pytest.mark.parametrize(
    ("n", "name", "operation", "point"),
    [(n, *row) for n, row in enumerate(TABLE)],
    ids=[f"{n}-{p}" for n, _, p in TABLE],
)
def test_a_crash_at_the_point_keeps_the_old_value_or_the_new(
    tmp_path: Path, shared: tuple[Gateway, Path], n: int, name: str, operation: Operation, point: str
) -> None:
    if name in OWN_GATEWAY:
        flags = tmp_path / "flags"
        flags.mkdir()
        gw = Gateway(tmp_path / "data", env=_crash_env(flags) | ENV[name])
    else:
        gw, flags = shared
    for left in ("arm", "fired"):  # by a row that failed before
        (flags / left).unlink(missing_ok=True)
    if gw.proc is None or gw.proc.poll() is not None:
        gw.start()
    run = Run(gw, key_for(1000 + n), flags, point)
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            allowed = operation(run, c)
        fired = flags / "fired"
        if gw.proc is not None and name != "scrub":
            try:
                gw.proc.wait(30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {name} never reached crash point {point!r}: the gateway is still running")
            assert gw.proc.returncode == -signal.SIGKILL, gw.log()[-2000:]
        assert fired.exists() and fired.read_text() == point, f"the {name} never reached crash point {point!r}"
        assert not (flags / "arm").exists()
        gw.start()  # unarmed: its start-up reconcile recovers
        others = [key_for(i) for i in range(2, 12)] if name == "evict" else []
        final = final_state(gw.url, [run.key, *others])
        digests = {None if v is None else digest_of(v) for v in allowed}
        assert final[run.key] in digests, f"after a crash at {point!r} in a {name}: {final[run.key]}"
        for i, key in enumerate(others, start=2):
            assert final[key] in (None, digest_of(random_bytes(BLOCK, i))), key
        assert index_rows(gw.data_dir) == block_files(gw.data_dir), "index rows and block files differ"
        assert not [p for p in run.blocks.rglob(".kvgate-tmp-*")], "a staged file is left"
        if name in ("part", "complete"):  # the object can be sent again, and completes
            with httpx.Client(base_url=gw.url, timeout=30) as c:
                for start, end in ((0, HALF), (HALF, BLOCK)):
                    got = _part(c, run.key, start, end)
                    assert got is not None and got.status_code < 300, got and got.text
                got_all = c.get(f"/v1/blocks/{run.key}")
                assert (got_all.status_code, got_all.content) == (200, NEW)
    finally:
        if name in OWN_GATEWAY:
            gw.stop()
