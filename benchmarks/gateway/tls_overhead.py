"""GET and PUT MB/s over plain HTTP, TLS, and mutual TLS, in one run on one machine: the cost of transport security.

    .venv/bin/python -m benchmarks.gateway.tls_overhead [--count 96] [--concurrency 16] [--block-size 2097152]

Starts three gateways on loopback (filesystem backend, each its own data dir): plain, HTTPS (server certificate,
ECDSA P-256, made here), and HTTPS requiring client certificates; then runs ``kvgate bench`` (one client process,
aiohttp) against each in turn, PUT then GET (every GET verified by sha256), for ``--rounds`` rounds interleaved
(plain, TLS, mutual TLS, plain, ...) so that load from elsewhere on the machine falls on all three alike, and prints
the median MB/s, the spread, and the ratio to plain. Client and servers share this machine's cores; the figures say
how many there were. CI does not run this.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loopback.gateway import REPO, Gateway
from loopback.tls_pki import CA, TlsGateway


def bench(url: str, out: Path, args: argparse.Namespace, tls: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "app", "bench", "--url", url, "--quiet", "--json", str(out), *tls]
    cmd += ["-c", str(args.concurrency), "-n", str(args.count), "--block-size", str(args.block_size)]
    cmd += ["--phases", "put,get"]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.read_text())
    if result["errors"] or result["verify_failures"]:
        raise SystemExit(f"bench against {url} had errors: {result['first_errors']}")
    return {op: s for p in result["phases"] for op, s in p["ops"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=96, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=2 * 1024 * 1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvgate-tls-bench-") as tmp:
        root = Path(tmp)
        ca = CA()
        ca_path = ca.write(root / "ca.pem")
        server = ca.issue("kvgate", server=True).write(root, "server")
        node = ca.issue("bench-node").write(root, "node")
        tls_env = {"KVGATE_TLS_CERTFILE": str(server[0]), "KVGATE_TLS_KEYFILE": str(server[1])}
        principals = json.dumps([{"name": "bench", "cert_subject": "CN=bench-node,O=kvgate-tests", "role": "write"}])
        mtls_env = {**tls_env, "KVGATE_TLS_CLIENT_CA": str(ca_path), "KVGATE_TOKENS": principals}
        server_auth = ["--cacert", str(ca_path)]
        mutual = [*server_auth, "--cert", str(node[0]), "--key", str(node[1])]
        runs: list[tuple[str, Gateway, list[str]]] = [
            ("plain HTTP", Gateway(root / "plain"), []),
            ("TLS", TlsGateway(root / "tls", ca=ca_path, env=tls_env), server_auth),
            ("mutual TLS", TlsGateway(root / "mtls", ca=ca_path, ready_cert=node, env=mtls_env), mutual),
        ]
        figures: dict[str, dict[str, list[float]]] = {name: {"put": [], "get": []} for name, _gw, _tls in runs}
        try:
            for _name, gw, _tls in runs:
                gw.start()
            for r in range(args.rounds):
                for name, gw, tls in runs:
                    ops = bench(gw.url, root / f"{name}-{r}.json", args, tls)
                    for op in ("put", "get"):
                        figures[name][op].append(ops[op]["mb_s"])
        finally:
            for _name, gw, _tls in runs:
                gw.stop()

    print(
        f"\nkvgate over TLS: {args.count} x {args.block_size} B per op, concurrency {args.concurrency}, "
        f"{os.cpu_count()} cores shared by client and server, aiohttp client, {args.rounds} rounds interleaved"
    )
    head = ["PUT MB/s (min-max)", "GET MB/s (min-max)"]
    print(f"{'transport':<12} {head[0]:>22} {head[1]:>22} {'PUT/plain':>10} {'GET/plain':>10}")
    base = {op: statistics.median(figures["plain HTTP"][op]) for op in ("put", "get")}
    for name, ops in figures.items():
        cells = []
        for op in ("put", "get"):
            med = statistics.median(ops[op])
            cells.append(f"{med:.1f} ({min(ops[op]):.0f}-{max(ops[op]):.0f})")
        ratios = [statistics.median(ops[op]) / base[op] for op in ("put", "get")]
        print(f"{name:<12} {cells[0]:>22} {cells[1]:>22} {ratios[0]:>10.2f} {ratios[1]:>10.2f}")


if __name__ == "__main__":
    main()
