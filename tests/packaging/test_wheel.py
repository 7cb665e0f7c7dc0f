"""The wheel as a user gets it: built, installed in a fresh venv, run from an empty directory (no checkout in sight).

Slow (one venv with every dependency), so it runs when KVGATE_WHEEL_TEST=1: CI's "wheel" step sets it.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import key_for, random_bytes
from tests.gateway import REPO, LoopbackProcess

pytestmark = [
    pytest.mark.wheel,
    pytest.mark.skipif(not os.environ.get("KVGATE_WHEEL_TEST"), reason="KVGATE_WHEEL_TEST=1 runs the wheel test"),
]


@dataclass(frozen=True)
class Installed:
    bin: Path
    site: Path

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a user has: no PYTHONPATH to the checkout, the venv's bin first on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGATE_", "PYTHON", "VIRTUAL_ENV"))}
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return {**env, "NO_COLOR": "1", "COLUMNS": "200", **extra}

    def run(self, argv: list[str], *, cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(self.bin / argv[0]), *argv[1:]], cwd=cwd, env=self.env(**extra), capture_output=True, text=True
        )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """``pip wheel . --no-deps``, then a fresh venv with that wheel (its dependencies from the package index)."""
    work = tmp_path_factory.mktemp("wheel")
    wheels = work / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)], check=True)
    (wheel,) = wheels.glob("kvgate-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], check=True)
    site = Path(
        subprocess.check_output(
            [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            text=True,
        ).strip()
    )
    yield Installed(bin=venv / "bin", site=site)
    shutil.rmtree(work, ignore_errors=True)


class InstalledGateway(LoopbackProcess):
    name = "installed gateway"

    def start(self, *, installed: Installed, cwd: Path) -> InstalledGateway:
        self._spawn(
            [str(installed.bin / "kvgate"), "serve", "--port", str(self.port)],
            env=installed.env(KVGATE_LOG_LEVEL="warning"),
            ready=lambda: httpx.get(f"{self.url}/readyz", timeout=1.0).status_code == 200,
            timeout_s=60.0,
            cwd=cwd,
        )
        return self


def curl(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["curl", "-sS", *args], capture_output=True, check=True)


def test_the_package_is_imported_from_the_venv(installed: Installed, tmp_path: Path) -> None:
    out = installed.run(
        ["python", "-c", "import app, connector; print(app.__file__, connector.__file__)"], cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert all(Path(p).is_relative_to(installed.site) for p in out.stdout.split())
    check = installed.run(["python", "-m", "pip", "check"], cwd=tmp_path)
    assert check.returncode == 0, check.stdout
    shipped = sorted(p.name for p in (installed.site / "app" / "migrations" / "versions").glob("*.py"))
    assert shipped == sorted(p.name for p in (REPO / "alembic" / "versions").glob("*.py"))


def test_serve_from_an_empty_directory_round_trips_a_block(installed: Installed, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    gw = InstalledGateway(port=None, log_path_for=lambda p: tmp_path / f"gateway-{p}.log")
    body = random_bytes(300_000, seed=14)
    (tmp_path / "block.bin").write_bytes(body)
    key = key_for(14)
    try:
        gw.start(installed=installed, cwd=empty)
        put = curl("-o", "/dev/null", "-w", "%{http_code}", "-X", "PUT", "--data-binary", f"@{tmp_path / 'block.bin'}",
                   f"{gw.url}/v1/blocks/{key}")  # fmt: skip
        assert put.stdout == b"201"
        got = curl("-f", f"{gw.url}/v1/blocks/{key}")
        assert got.stdout == body
        docs = curl("-f", f"{gw.url}/docs").stdout.decode()
        assert "/docs/assets/swagger-ui-bundle.js" in docs
        assert len(curl("-f", f"{gw.url}/docs/assets/swagger-ui-bundle.js").stdout) > 100_000
    finally:
        gw.stop()
    assert (empty / "kvgate-data" / "index.db").is_file()
    assert (empty / "kvgate-data" / "blocks" / key).read_bytes() == body

    gc = installed.run(["kvgate", "gc", "--json"], cwd=empty)
    assert gc.returncode == 0, gc.stderr
    report = json.loads(gc.stdout)
    assert report["blocks"] == 1 and report["bytes"] == len(body) and report["rows_dropped"] == 0


def test_import_a_vllm_directory(installed: Installed, tmp_path: Path) -> None:
    source = tmp_path / "vllm-fs-tier"
    key = key_for(7)
    (source / key).parent.mkdir(parents=True)
    (source / key).write_bytes(b"kv" * 5000)
    (source / "stray.tmp").write_bytes(b"x")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = installed.run(["kvgate", "import", str(source)], cwd=empty)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["blocks"], report["skipped"], report["failed"]) == (1, 1, 0)
    assert (empty / "kvgate-data" / "blocks" / key).read_bytes() == b"kv" * 5000


def test_alembic_upgrade_head_from_the_install(installed: Installed, tmp_path: Path) -> None:
    ini = installed.run(["kvgate", "migrate", "--alembic-ini"], cwd=tmp_path)
    assert ini.returncode == 0, ini.stderr
    assert Path(ini.stdout.strip()).is_relative_to(installed.site)
    data = tmp_path / "data"
    out = installed.run(
        ["alembic", "-c", ini.stdout.strip(), "upgrade", "head"], cwd=tmp_path, KVGATE_DATA_DIR=str(data)
    )
    assert out.returncode == 0, out.stderr
    heads = installed.run(["alembic", "-c", ini.stdout.strip(), "heads"], cwd=tmp_path)
    head = heads.stdout.split()[0]
    with sqlite3.connect(data / "index.db") as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(head,)]
    again = installed.run(["kvgate", "migrate"], cwd=tmp_path, KVGATE_DATA_DIR=str(data))
    assert again.returncode == 0 and "index at head" in again.stdout, again.stderr
