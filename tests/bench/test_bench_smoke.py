"""``kvgate bench`` against a real gateway: it runs, the JSON has the figures, every GET's bytes check out.

No timing assertions: speed is measured by benchmarks/gateway/compare.py, which prints ratios against nginx.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from app.tools.bench import NAMESPACE, Payloads, bench_key
from contract.keys import parse_block_key
from tests.gateway import REPO, Gateway

FIELDS = {
    "requests",
    "ok",
    "misses",
    "errors",
    "verify_failures",
    "bytes",
    "seconds",
    "mb_s",
    "req_s",
    "p50_ms",
    "p99_ms",
}


def run_bench(url: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "app", "bench", "--url", url, "--json", str(out), "--quiet", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def ops_of(result: dict) -> dict[str, dict]:
    return {op: s for p in result["phases"] for op, s in p["ops"].items()}


def test_phases_report_every_op_and_verify_bytes(gateway: Gateway, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = run_bench(
        gateway.url, out, "-c", "4", "-n", "12", "--block-size", "300000", "--phases", "put,get,head:40,lookup:5"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    ops = ops_of(result)
    assert set(ops) == {"put", "get", "head", "lookup"}
    for stats in ops.values():
        assert set(stats) >= FIELDS
        assert stats["errors"] == 0 and stats["verify_failures"] == 0
        assert stats["ok"] == stats["requests"]
    assert ops["put"]["requests"] == 12 and ops["head"]["requests"] == 40 and ops["lookup"]["requests"] == 5
    assert ops["get"]["bytes"] == 12 * 300000 and ops["put"]["bytes"] == 12 * 300000
    assert ops["get"]["mb_s"] > 0 and ops["head"]["req_s"] > 0 and ops["get"]["p99_ms"] >= ops["get"]["p50_ms"] > 0
    assert result["errors"] == 0 and result["verify_failures"] == 0
    # the blocks really are in the gateway, under valid keys, with the bytes the bench says it sent
    cfg = result["config"]
    payloads = Payloads(block_size=cfg["block_size"], keys=12, seed=cfg["seed"])
    key = bench_key(seed=cfg["seed"], i=3)
    assert parse_block_key(key).namespace == NAMESPACE
    body = httpx.get(f"{gateway.url}/v1/blocks/{key}").content
    assert body == bytes(payloads.body(3))


def test_wrong_bytes_are_reported_not_timed(gateway: Gateway, tmp_path: Path) -> None:
    """A GET that returns other bytes than were PUT is a verify failure and a non-zero exit."""
    out = tmp_path / "a.json"
    assert run_bench(gateway.url, out, "-c", "2", "-n", "6", "--block-size", "4096", "--phases", "put").returncode == 0
    # same keys (seed 0), other bytes: overwrite key 2 behind the bench's back
    key = bench_key(seed=0, i=2)
    assert httpx.put(f"{gateway.url}/v1/blocks/{key}", content=b"x" * 4096).status_code in (200, 201)
    out2 = tmp_path / "b.json"
    proc = run_bench(gateway.url, out2, "-c", "2", "-n", "60", "--block-size", "4096", "--phases", "get", "--keys", "6")
    result = json.loads(out2.read_text())
    assert proc.returncode == 1
    assert ops_of(result)["get"]["verify_failures"] >= 1
    assert any("wrong bytes" in e for e in result["first_errors"])


def test_mix_with_zipf_and_httpx_client(gateway: Gateway, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    proc = run_bench(
        gateway.url, out, "-c", "3", "-n", "40", "--keys", "8", "--block-size", "8192",
        "--mix", "put=1,get=3,head=1", "--distribution", "zipf", "--client", "httpx",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    ops = ops_of(result)
    assert sum(s["requests"] for s in ops.values()) == 40
    assert all(s["errors"] == 0 and s["verify_failures"] == 0 for s in ops.values())
    # GETs of keys not yet written are misses (404), never errors
    assert all(s["ok"] + s["misses"] == s["requests"] for s in ops.values())
