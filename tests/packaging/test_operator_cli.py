"""Operator commands as scripts use them: --json on stdout, progress and errors on stderr, documented exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
from typer.testing import CliRunner

from app.tools.cli import cli
from tests.conftest import TEST_NS, key_for
from tests.gateway import REPO, Gateway, free_port


def kvgate(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "app", *args],
        cwd=cwd,
        env={**env, "PYTHONPATH": str(REPO), "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ls_and_stats_print_json(gateway: Gateway, tmp_path: Path) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        for i in range(3):
            assert c.put(f"/v1/blocks/{key_for(i)}", content=b"j" * 1000).status_code == 201
        assert c.get(f"/v1/blocks/{key_for(0)}").status_code == 200
        api_ls, api_stats = c.get("/v1/namespaces").json(), c.get("/v1/stats").json()

    ls = kvgate("ls", "--json", "--url", gateway.url, cwd=tmp_path)
    assert ls.returncode == 0, ls.stderr
    assert json.loads(ls.stdout) == api_ls
    (ns,) = json.loads(ls.stdout)["namespaces"]
    assert (ns["namespace"], ns["blocks"], ns["bytes"], ns["hits"]) == (TEST_NS, 3, 3000, 1)

    stats = kvgate("stats", "--json", "--url", gateway.url, cwd=tmp_path)
    assert stats.returncode == 0, stats.stderr
    got = json.loads(stats.stdout)
    assert (got["blocks"], got["usage_bytes"], got["hits"]) == (3, 3000, 1)
    assert got.keys() == api_stats.keys()


def test_import_and_gc_show_progress_on_stderr_and_json_on_stdout(tmp_path: Path) -> None:
    source = tmp_path / "src"
    for i in range(5):
        (source / key_for(i)).parent.mkdir(parents=True, exist_ok=True)
        (source / key_for(i)).write_bytes(bytes([i]) * 2000)
    imp = kvgate("import", str(source), "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert imp.returncode == 0, imp.stderr
    assert json.loads(imp.stdout)["blocks"] == 5
    assert "import" in imp.stderr and "5/5" in imp.stderr

    gc = kvgate("gc", "--json", "--data-dir", str(tmp_path / "data"), cwd=tmp_path)
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["blocks"] == 5
    assert "scan" in gc.stderr and "digest" in gc.stderr


def test_exit_codes(tmp_path: Path) -> None:
    unreachable = kvgate("stats", "--json", "--url", f"http://127.0.0.1:{free_port()}", cwd=tmp_path)
    assert unreachable.returncode == 2 and unreachable.stdout == "" and "cannot reach" in unreachable.stderr
    missing = kvgate("import", str(tmp_path / "nowhere"), "--data-dir", str(tmp_path / "d"), cwd=tmp_path)
    assert missing.returncode == 2 and "not a directory" in missing.stderr
    bad_flag = kvgate("ls", "--no-such-flag", cwd=tmp_path)
    assert bad_flag.returncode == 2
    helped = CliRunner().invoke(cli, ["--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert helped.exit_code == 0 and "Exit codes: 0 done; 1" in helped.output
