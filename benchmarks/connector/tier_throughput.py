"""Store and load throughput of KVGateTier (vLLM 0.33 secondary tier) against a local gateway, with vLLM's own fs
tier on the same disk as the baseline of the same run. Run it with the oracle venv's python (it imports vllm):

    /tmp/vllm-oracle/bin/python benchmarks/connector/tier_throughput.py [--rows 128] [--row-mib 2] [--job-rows 16]
        [--no-fsync]

It starts a gateway (``--gateway-python``, default .venv/bin/python, ``python -m app serve``) on a loopback port with
its data under a temp dir, or uses ``--url``. Both tiers are built by vLLM's SecondaryTierFactory over one
page-aligned primary region; every loaded row is checked against the stored one (outside the timings).
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from loopback.vllm_tier import Steps, keys_for, kvgate_tier_cfg, make_spec, standalone_tier  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_gateway(python: str, data_dir: Path, *, fsync: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "KVGATE_DATA_DIR": str(data_dir),
        "KVGATE_LOG_LEVEL": "warning",
        "KVGATE_BACKEND__KIND": "fs",
        "KVGATE_BACKEND__FSYNC": "true" if fsync else "false",
        "KVGATE_MAX_BLOCK_BYTES": str(1 << 30),
    }
    proc = subprocess.Popen([python, "-m", "app", "serve", "--port", str(port)], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1.0) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("gateway did not become ready")


def run_tier(tier: Any, view: memoryview, *, rows: int, job_rows: int, seed: str) -> dict[str, float]:
    """Store rows [0, rows) then load them into [rows, 2*rows); seconds of each, and a byte check."""
    size = view.strides[0]
    flat = view.cast("B")
    steps = Steps(tier)
    keys = keys_for(rows, seed)
    t0 = time.perf_counter()
    jobs = {
        steps.job(keys[i : i + job_rows], list(range(i, min(i + job_rows, rows))), load=False)
        for i in range(0, rows, job_rows)
    }
    stored = steps.wait(jobs, timeout_s=600)
    store_s = time.perf_counter() - t0
    if not all(r.success for r in stored.values()) or len(stored) != len(jobs):
        raise SystemExit(f"{tier.tier_type}: stores failed: {stored}")
    steps.lookups(keys, "bench")  # kvgate: one batched lookup; fs: existence checks
    t0 = time.perf_counter()
    jobs = {
        steps.job(keys[i : i + job_rows], list(range(rows + i, rows + min(i + job_rows, rows))), load=True, req="bench")
        for i in range(0, rows, job_rows)
    }
    loaded = steps.wait(jobs, timeout_s=600)
    load_s = time.perf_counter() - t0
    if not all(r.success for r in loaded.values()) or len(loaded) != len(jobs):
        raise SystemExit(f"{tier.tier_type}: loads failed: {loaded}")
    for i in range(rows):
        a = hashlib.sha256(flat[i * size : (i + 1) * size]).digest()
        b = hashlib.sha256(flat[(rows + i) * size : (rows + i + 1) * size]).digest()
        if a != b:
            raise SystemExit(f"{tier.tier_type}: row {i} differs after the round trip")
    steps.finish("bench")
    return {"store_s": store_s, "load_s": load_s, "worst_call_s": steps.worst_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--row-mib", type=float, default=2.0)
    parser.add_argument("--job-rows", type=int, default=16, help="rows per store/load job (vLLM batches per request)")
    parser.add_argument("--max-inflight-mib", type=int, default=256)
    parser.add_argument("--no-fsync", action="store_true", help="gateway without fsync (vLLM's fs tier never fsyncs)")
    parser.add_argument("--url", help="use this gateway instead of starting one")
    parser.add_argument("--gateway-python", default=str(REPO / ".venv" / "bin" / "python"))
    args = parser.parse_args()

    row_bytes = int(args.row_mib * 1024 * 1024) // 4096 * 4096
    n_chunks = 2 * args.rows
    region = mmap.mmap(-1, n_chunks * row_bytes)
    view = memoryview(region).cast("B", (n_chunks, row_bytes))
    rng = random.Random(7)
    flat = view.cast("B")
    for i in range(args.rows):
        flat[i * row_bytes : (i + 1) * row_bytes] = rng.randbytes(row_bytes)
    spec = make_spec([], num_chunks=n_chunks, row_bytes=row_bytes, engine_id="bench")

    work = Path(tempfile.mkdtemp(prefix="kvgate-tier-bench-"))
    proc = None
    try:
        url = args.url
        if url is None:
            proc, url = start_gateway(args.gateway_python, work / "gw", fsync=not args.no_fsync)
        results: dict[str, dict[str, float]] = {}
        fs = standalone_tier(spec, {"type": "fs", "root_dir": str(work / "fs")}, view)
        results["vllm fs tier (baseline)"] = run_tier(fs, view, rows=args.rows, job_rows=args.job_rows, seed="fs")
        fs.shutdown()
        tier = standalone_tier(
            spec, kvgate_tier_cfg(url, max_inflight_bytes=args.max_inflight_mib << 20, transfer_timeout_s=120.0), view
        )
        results["kvgate tier"] = run_tier(tier, view, rows=args.rows, job_rows=args.job_rows, seed="kvgate")
        tier.shutdown()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(work, ignore_errors=True)

    mb = args.rows * row_bytes / 1e6
    fsync = "off" if args.no_fsync else "on"
    print(f"rows={args.rows} row={row_bytes / 2**20:.2f} MiB job_rows={args.job_rows} gateway fsync={fsync}")
    print(f"{'tier':26} {'op':5} {'rows/s':>9} {'MB/s':>9} {'vs fs':>7} {'worst call ms':>14}")
    base = results["vllm fs tier (baseline)"]
    for name, r in results.items():
        for op in ("store", "load"):
            secs = r[f"{op}_s"]
            ratio = base[f"{op}_s"] / secs
            worst_ms = r["worst_call_s"] * 1e3
            print(f"{name:26} {op:5} {args.rows / secs:9.1f} {mb / secs:9.1f} {ratio:7.2f} {worst_ms:14.3f}")


if __name__ == "__main__":
    main()
