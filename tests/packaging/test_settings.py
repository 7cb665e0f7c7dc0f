"""Settings that explain themselves: nested ones alone, one clear line and exit 2 on a bad one, docs that agree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from app.config import FsBackend, Settings
from app.settings_help import SETTINGS_DOC, markdown_table, rows, table_section
from app.tools.cli import cli
from tests.conftest import key_for
from tests.gateway import REPO, Gateway


def test_a_nested_setting_alone_keeps_the_default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVGATE_BACKEND__FSYNC", "false")
    backend = Settings().backend
    assert isinstance(backend, FsBackend) and backend.fsync is False


def test_the_gateway_starts_with_a_nested_setting_alone(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data", env={"KVGATE_BACKEND__FSYNC": "false"}).start()
    try:
        key = key_for(1)
        assert httpx.put(f"{gw.url}/v1/blocks/{key}", content=b"b" * 4096).status_code == 201
        assert httpx.get(f"{gw.url}/v1/blocks/{key}").content == b"b" * 4096
    finally:
        gw.stop()


SYNC = "'OFF', 'NORMAL' or 'FULL'"
BAD = [
    ({"KVGATE_PORT": "http"}, "KVGATE_PORT='http': Input should be a valid integer"),
    ({"KVGATE_SQLITE_SYNCHRONOUS": "sometimes"}, "KVGATE_SQLITE_SYNCHRONOUS='sometimes': Input should be " + SYNC),
    ({"KVGATE_BACKEND__KIND": "nfs"}, "KVGATE_BACKEND__KIND='nfs': should be 'fs', 's3', 'memory'"),
    ({"KVGATE_BACKEND__BUCKET": "b"}, "KVGATE_BACKEND__BUCKET: not a setting of this backend"),
    ({"KVGATE_BACKEND__KIND": "s3"}, "KVGATE_BACKEND__BUCKET: required"),
    ({"KVGATE_BACKEND__FSYNC": "maybe"}, "KVGATE_BACKEND__FSYNC='maybe': Input should be a valid boolean"),
    ({"KVGATE_HIGH_WATERMARK": "1.5"}, "KVGATE_HIGH_WATERMARK='1.5': Input should be less than or equal to 1"),
    ({"KVGATE_TOKENS": "[{"}, 'settings: error parsing value for field "tokens"'),
    ({"KVGATE_TOKENS": '[{"name": "a", "sha256": "00", "role": "read"}]'}, "KVGATE_TOKENS[0].sha256='00': String"),
]  # fmt: skip


@pytest.mark.parametrize(("env", "line"), BAD, ids=[next(iter(e)) + "=" + next(iter(e.values())) for e, _ in BAD])
def test_a_bad_setting_is_one_line_and_exit_2(tmp_path: Path, env: dict[str, str], line: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_")}
    out = subprocess.run(
        [sys.executable, "-m", "app", "serve"],
        cwd=tmp_path,
        env={**clean, "PYTHONPATH": str(REPO), "KVGATE_DATA_DIR": str(tmp_path / "d"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvgate: {line}"), out.stderr
    assert not (tmp_path / "d").exists()


def test_the_settings_table_is_the_generated_one() -> None:
    doc = (REPO / SETTINGS_DOC).read_text()
    assert table_section(doc) == markdown_table(), f"regenerate it: python -m app.settings_help ({SETTINGS_DOC})"


def test_serve_help_lists_every_setting() -> None:
    out = CliRunner().invoke(cli, ["serve", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert out.exit_code == 0
    listed = set(re.findall(r"\bKVGATE_[A-Z0-9_]+", out.output))
    assert listed == {r.variable for r in rows()}


def test_every_field_is_listed_and_described() -> None:
    variables = {r.variable for r in rows()}
    for name in Settings.model_fields:
        if name != "backend":
            assert f"KVGATE_{name.upper()}" in variables
    assert all(r.meaning for r in rows()), [r.variable for r in rows() if not r.meaning]
