"""Soak: N concurrent clients of mixed PUT/GET/HEAD/lookup against a real gateway for a bounded time.

Every read is checked byte for byte against what that client last wrote; any other status or a transport error
counts as an error. The server's RSS is sampled from /proc/<pid>/status. Run:

    .venv/bin/python -m benchmarks.gateway.soak --duration 120 --clients 64
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from app.api.middleware.principals import hash_token
from contract.keys import block_path
from loopback.gateway import Gateway

NAMESPACE = "soak-model_0123456789ab"
TOKEN = "soak-writer-token"


@dataclass
class Figures:
    clients: int
    duration_s: float
    requests: int = 0
    errors: int = 0
    mismatches: int = 0
    by_op: dict[str, int] = field(default_factory=dict)
    rss_start_kib: int = 0
    rss_peak_kib: int = 0
    rss_end_kib: int = 0
    rss_by_minute_kib: list[int] = field(default_factory=list)
    """The server's RSS at the end of each minute of load: steady, or growing."""
    first_errors: list[str] = field(default_factory=list)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def key(client: int, slot: int) -> str:
    digest = hashlib.sha256(f"{client}/{slot}".encode()).digest()
    return block_path(namespace=NAMESPACE, rank=0, block_hash=digest, group=0)


async def client_loop(c: httpx.AsyncClient, n: int, *, until: float, slots: int, size: int, fig: Figures) -> None:
    rng = random.Random(n)
    mine: dict[str, bytes] = {}
    version = 0

    def fail(what: str) -> None:
        fig.errors += 1
        if len(fig.first_errors) < 10:
            fig.first_errors.append(what)

    while time.monotonic() < until:
        op = rng.choice(["put", "put", "get", "get", "head", "lookup"]) if mine else "put"
        fig.requests += 1
        fig.by_op[op] = fig.by_op.get(op, 0) + 1
        try:
            if op == "put":
                k = key(n, rng.randrange(slots))
                version += 1
                data = random.Random(f"{n}/{version}").randbytes(size)
                r = await c.put(f"/v1/blocks/{k}", content=data)
                if r.status_code in (200, 201):
                    mine[k] = data
                else:
                    fail(f"put {r.status_code} {r.text[:100]}")
            elif op == "get":
                k = rng.choice(list(mine))
                r = await c.get(f"/v1/blocks/{k}")
                if r.status_code != 200:
                    fail(f"get {r.status_code}")
                elif r.content != mine[k]:
                    fig.mismatches += 1
                    fail("get bytes differ")
            elif op == "head":
                k = rng.choice(list(mine))
                r = await c.head(f"/v1/blocks/{k}")
                if r.status_code != 200 or int(r.headers["content-length"]) != len(mine[k]):
                    fail(f"head {r.status_code}")
            else:
                keys = [*list(mine)[:8], key(n, slots + 1)]  # all present, then one miss
                r = await c.post("/v1/lookup", json={"keys": keys})
                if r.status_code != 200 or r.json()["prefix"] != len(keys) - 1:
                    fail(f"lookup {r.status_code} {r.text[:100]}")
        except httpx.HTTPError as exc:
            fail(f"{op} {type(exc).__name__}: {exc}")


async def run_soak(
    url: str, pid: int, *, duration_s: float, clients: int, slots: int = 40, size: int = 16384
) -> Figures:
    fig = Figures(clients=clients, duration_s=duration_s)
    fig.rss_start_kib = fig.rss_peak_kib = rss_kib(pid)
    until = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def sample() -> None:
        began = time.monotonic()
        while time.monotonic() < until:
            rss = rss_kib(pid)
            fig.rss_peak_kib = max(fig.rss_peak_kib, rss)
            if time.monotonic() - began >= 60 * (len(fig.rss_by_minute_kib) + 1):
                fig.rss_by_minute_kib.append(rss)
            await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits, headers=headers) as c:
        await asyncio.gather(
            sample(), *(client_loop(c, n, until=until, slots=slots, size=size, fig=fig) for n in range(clients))
        )
    fig.rss_end_kib = rss_kib(pid)
    return fig


def soak_gateway(data_dir: Path) -> Gateway:
    tokens = json.dumps([{"name": "soak", "sha256": hash_token(TOKEN), "role": "write"}])
    return Gateway(data_dir, env={"KVGATE_TOKENS": tokens}).start()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--size", type=int, default=16384, help="bytes per block")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-soak-") as tmp:
        gw = soak_gateway(Path(tmp) / "data")
        try:
            assert gw.proc is not None
            fig = asyncio.run(
                run_soak(gw.url, gw.proc.pid, duration_s=args.duration, clients=args.clients, size=args.size)
            )
        finally:
            gw.stop()
    print(json.dumps(asdict(fig), indent=2))
    print(
        f"soak: {fig.requests} requests in {fig.duration_s:.0f}s by {fig.clients} clients "
        f"({fig.requests / fig.duration_s:.0f}/s), errors {fig.errors}, byte mismatches {fig.mismatches}, "
        f"server RSS {fig.rss_start_kib} KiB -> {fig.rss_end_kib} KiB (peak {fig.rss_peak_kib} KiB); "
        f"by minute (MiB): {' '.join(str(r // 1024) for r in fig.rss_by_minute_kib)}"
    )
    if fig.errors:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
