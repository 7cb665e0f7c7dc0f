"""PostgreSQL of one's own: Debian's binaries (``apt-get install postgresql``), initdb into a temp dir and pg_ctl on a
free loopback port, as the ``postgres`` user when run as root. tests/services.py has the fixtures that start it (or
take ``KVGATE_TEST_PG_URL``)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from loopback.gateway import free_port


def wait_port(port: int, *, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout_s}s")


def pg_bindir() -> Path | None:
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
        """initdb (the first time only) and start; after ``crash`` the server recovers from its WAL."""
        if not (self.datadir / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.datadir), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.datadir), "-l", str(self.root / "pg.log"), "-o", opts, "-w", "start")
        wait_port(self.port, timeout_s=30)
        return PgServer(base_url=f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres")

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every server process quits at once, with no shutdown checkpoint, as in a
        crash; connections drop."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run("pg_ctl", "-D", str(self.datadir), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
