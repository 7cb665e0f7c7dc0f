"""kvgate ls / stats / purge against a real gateway, and kvgate gc on a data dir."""

from __future__ import annotations

from pathlib import Path

import httpx
from typer.testing import CliRunner

from app.tools.cli import cli
from tests.capacity.helpers import block_files, index_rows
from tests.conftest import TEST_NS, key_for
from tests.gateway import Gateway

WIDE = {"COLUMNS": "250", "NO_COLOR": "1"}


def cells(output: str) -> dict[str, str]:
    """A two-column rich table as {first cell: second cell}."""
    rows = [line.split("│") for line in output.splitlines() if line.count("│") >= 3]
    return {r[1].strip(): r[2].strip() for r in rows}


def test_ls_stats_purge(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        for i in range(7):
            assert c.put(f"/v1/blocks/{key_for(i)}", content=b"k" * 2048).status_code == 201
        assert c.get(f"/v1/blocks/{key_for(0)}").status_code == 200
    runner = CliRunner()
    env = {**WIDE, "KVGATE_URL": gateway.url}

    ls = runner.invoke(cli, ["ls"], env=env)
    assert ls.exit_code == 0, ls.output
    row = next(line for line in ls.output.splitlines() if TEST_NS in line)
    assert "7" in row.split() and "14.0 KiB" in row and "85.7%" in row

    st = runner.invoke(cli, ["stats", "--url", gateway.url], env=WIDE)
    assert st.exit_code == 0, st.output
    assert "14.0 KiB" in st.output and "unbounded" in st.output
    rows = cells(st.output)
    assert rows["blocks"] == "7" and rows["hits"] == "1" and rows["evictions"] == "0 (0 B)"

    refused = runner.invoke(cli, ["purge", TEST_NS], env=env, input="n\n")
    assert refused.exit_code == 1
    assert httpx.head(f"{gateway.url}/v1/blocks/{key_for(1)}").status_code == 200

    pr = runner.invoke(cli, ["purge", TEST_NS, "--yes"], env=env)
    assert pr.exit_code == 0, pr.output
    assert "7 blocks" in pr.output
    assert httpx.head(f"{gateway.url}/v1/blocks/{key_for(1)}").status_code == 404

    again = runner.invoke(cli, ["purge", TEST_NS, "--yes"], env=env)
    assert again.exit_code == 1 and "404" in again.output


def test_cli_reports_an_unreachable_gateway() -> None:
    from tests.gateway import free_port

    r = CliRunner().invoke(cli, ["stats", "--url", f"http://127.0.0.1:{free_port()}"], env=WIDE)
    assert r.exit_code == 2 and "cannot reach" in r.output


def test_gc_reconciles_a_data_dir(tmp_path: Path) -> None:
    gw = Gateway(tmp_path / "data").start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as c:
            for i in range(20):
                assert c.put(f"/v1/blocks/{key_for(i)}", content=b"g" * 512).status_code == 201
    finally:
        gw.stop()
    root = gw.data_dir / "blocks"
    for i in range(5):
        (root / key_for(i)).unlink()
    for i in range(100, 103):
        p = root / key_for(i)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"adopted")
    old_temp = root / ".kvgate-tmp-old"
    old_temp.write_bytes(b"x")
    r = CliRunner().invoke(cli, ["gc", "--data-dir", str(gw.data_dir)], env=WIDE)
    assert r.exit_code == 0, r.output
    lines = cells(r.output)
    assert lines["rows dropped (no data)"] == "5"
    assert lines["blocks adopted (no row)"] == "3"
    assert lines["temp files removed"] == "1"
    assert lines["blocks now"] == "18"
    assert index_rows(gw.data_dir) == block_files(gw.data_dir)
    assert not old_temp.exists()


def test_admin_commands_send_the_token(tmp_path: Path) -> None:
    import hashlib
    import json

    token = "admin-secret-for-tests"
    spec = [{"name": "ops", "sha256": hashlib.sha256(token.encode()).hexdigest(), "role": "admin"}]
    gw = Gateway(tmp_path / "data", env={"KVGATE_TOKENS": json.dumps(spec)}).start()
    try:
        runner = CliRunner()
        denied = runner.invoke(cli, ["stats", "--url", gw.url], env=WIDE)
        assert denied.exit_code == 1 and "401" in denied.output
        ok = runner.invoke(cli, ["ls", "--url", gw.url], env={**WIDE, "KVGATE_TOKEN": token})
        assert ok.exit_code == 0, ok.output
        assert runner.invoke(cli, ["stats", "--url", gw.url, "--token", token], env=WIDE).exit_code == 0
    finally:
        gw.stop()
