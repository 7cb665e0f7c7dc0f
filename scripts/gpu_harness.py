"""What scripts/gpu_check.py's hazards run on: an in-memory client on a loop thread of its own, the connector's hooks
(on today's API or on the one before issue 18), a model's caches and jobs, a canonical-bytes reference, and the
forward stream with a calibrated long kernel."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import itertools
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import ClientStats
from connector.planning.plan import BlockJob
from connector.worker.pipeline import WorkerPipeline
from contract.keys import KVGroup, RunNaming, naming

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class MemoryClient:
    """What WorkerPipeline needs from BlockClient, in memory, on a loop thread of its own (named like the real one)."""

    def __init__(self) -> None:
        self.stats = ClientStats()
        self.objects: dict[str, bytes] = {}
        self.inflight_bytes = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvgate-client", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def run(self, coro: Coroutine[Any, Any, Any], *, timeout_s: float | None = None) -> Any:
        return self.submit(coro).result(timeout=timeout_s)

    def reserve(self, nbytes: int, *, count: bool = True) -> bool:
        self.inflight_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.inflight_bytes -= nbytes

    async def put(
        self, key: str, data: Any, *, content_range: Any = None, create_only: bool = False, meta: Any = None
    ) -> bool:
        self.objects[key] = bytes(data)
        return True

    async def get(self, key: str, *, byte_range: Any = None, expected_digest: Any = None) -> bytes | None:
        return self.objects.get(key)

    async def get_into(
        self, key: str, into: memoryview, *, byte_range: Any = None, expected_digest: Any = None
    ) -> bool:
        data = self.objects.get(key)
        if data is not None and byte_range is not None:
            data = data[byte_range[0] : byte_range[1]]
        if data is None or len(data) != into.nbytes:
            return False
        into[:] = data
        return True

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


# -- the connector's hooks, on today's API or on the one before issue 18 -----------------------------------------


def start_loads(p: WorkerPipeline, jobs: list[BlockJob]) -> None:
    if hasattr(p, "start_loads"):
        p.start_loads(jobs)
    else:
        for job in jobs:
            p.load(job)


def start_stores(p: WorkerPipeline, jobs: list[BlockJob]) -> None:
    if hasattr(p, "start_stores"):
        p.start_stores(jobs)
    else:
        for job in jobs:
            p.store(job)


def before_step(p: WorkerPipeline, preempted: list[str]) -> None:
    if hasattr(p, "before_step"):
        p.before_step(preempted=preempted)
    else:
        p.sync_copies()


def finished_stores(p: WorkerPipeline, req_ids: set[str]) -> set[str]:
    if hasattr(p, "finished_stores"):
        return p.finished_stores(req_ids)
    return {r for r in req_ids if p.copies_done(r)}


# -- a model -----------------------------------------------------------------------------------------------------


class Model:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(args.layers))
        self.hashes = (hashlib.sha256(f"block/{i}".encode()).digest() for i in itertools.count())

    def caches(self, seed: int) -> dict[str, torch.Tensor]:
        a = self.args
        g = torch.Generator(device=self.device).manual_seed(seed)
        shape = (2, a.num_blocks, a.block_size, a.heads, a.head_size)
        return {
            n: torch.randint(-(2**15), 2**15, shape, generator=g, device=self.device, dtype=torch.int32)
            .to(torch.int16)
            .view(torch.bfloat16)
            for n in self.names
        }

    def naming(self) -> RunNaming:
        a = self.args
        return naming(
            model_name="kvgate/gpu-check",
            tokens_per_hash=a.block_size,
            tp_size=1,
            rank=0,
            dtype="bfloat16",
            groups=[KVGroup(tokens_per_block=a.block_size, layer_names=self.names)],
            num_kv_heads=a.heads,
            total_kv_heads=a.heads,
        )

    def pipeline(self, client: MemoryClient, caches: dict[str, torch.Tensor], **kw: int) -> WorkerPipeline:
        opts = {"max_blocks_per_batch": 8, "store_buffers": 4, "load_buffers": 2} | kw
        xfer = BlockTransfer(kv_caches=caches, layout=KVLayout.NHD, **opts)
        return WorkerPipeline(client=client, naming=self.naming(), transfers=[xfer], tp_size=1, tp_rank=0)  # type: ignore[arg-type]

    def job(self, req: str, ids: list[int], hashes: tuple[bytes, ...] | None = None) -> BlockJob:
        hs = hashes if hashes is not None else tuple(next(self.hashes) for _ in ids)
        return BlockJob(req_id=req, hashes=hs, block_ids=(tuple(ids),))


def canonical(layers: list[torch.Tensor], block: int) -> bytes:
    """The canonical bytes of one block, ``[head][layer][k|v][token][dim]``, by explicit indexing on the host."""
    host = [t[:, block].cpu() for t in layers]  # (2, token, head, dim) each, NHD
    rows = [host[layer][kv, :, h] for h in range(host[0].shape[2]) for layer in range(len(host)) for kv in range(2)]
    return torch.stack(rows).contiguous().view(torch.uint8).numpy().tobytes()


def same_blocks(a: torch.Tensor, ids_a: list[int], b: torch.Tensor, ids_b: list[int]) -> bool:
    return torch.equal(a[:, ids_a].view(torch.int16).cpu(), b[:, ids_b].view(torch.int16).cpu())


def poll(done: Callable[[], bool], *, limit_s: float = 60.0) -> None:
    end = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


class Gpu:
    """The forward stream (current on the main thread, as in vLLM) and a calibrated long kernel.

    On a CPU (``--dry-run``) there are no streams: the hazards then only check this script's own bookkeeping."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type != "cuda":
            return
        self.forward = torch.cuda.Stream(device=device)
        torch.cuda.set_stream(self.forward)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        self.cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1000)

    def busy(self, seconds: float) -> None:
        """Queue ``seconds`` of spinning on the forward stream."""
        if self.device.type == "cuda":
            torch.cuda._sleep(int(self.cycles_per_s * seconds))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
