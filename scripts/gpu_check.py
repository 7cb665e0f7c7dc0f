"""Adversarial GPU check of the connector's copy path: one verdict per hazard, exit 1 on any failure.

    python scripts/gpu_check.py             # on a CUDA machine (about a minute on one H100/H200)
    python scripts/gpu_check.py --strict    # a skipped hazard (no CUDA, no vLLM for the layouts) is a failure

It drives the worker pipeline the way vLLM 0.33 does: the "forward pass" runs on a dedicated non-default stream that
the main thread makes current (``torch.cuda.set_stream``, as vLLM's ``current_stream()`` does), the connector's hooks
are called on the main thread, and loads are scattered from the client's event-loop thread. The network is an
in-memory client on its own loop thread (the subject is the GPU path, not HTTP). Long kernels (``torch.cuda._sleep``)
keep work queued so that a missing dependency shows up as wrong bytes instead of a lucky ordering.

Hazards (issue 18):
  load-order       a block write queued on the forward stream before start_load_kv must land before the load
  store-overwrite  the blocks' next writer (a preemption, the next step) must not overwrite them under the gather
  finish-early     get_finished must not hand back blocks whose gather is still queued
  buffer-return    a pinned buffer returned on an error path must not be reused under a queued copy
  many-steps       many concurrent steps with small pools: every stored object and every load byte-exact
  preempt-stall    handle_preemptions must not wait on the host for the forward pass (timed; ratio printed)
  layouts          caches built as vLLM 0.33 declares them (KVCacheLayout orders, heads == block size, bf16 and
                   fp8) through the connector's layout mapping, against an independently built canonical reference

The script also runs against an older checkout (it falls back to the hooks main had), so it can show "before".
"""

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

from connector.client import ClientStats
from connector.pipeline import WorkerPipeline
from connector.plan import BlockJob
from connector.protocol import KVGroup, RunNaming, naming
from connector.transfer import BlockTransfer, KVLayout

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

    def reserve(self, nbytes: int) -> bool:
        self.inflight_bytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.inflight_bytes -= nbytes

    async def put(self, key: str, data: Any, *, content_range: Any = None, create_only: bool = False) -> bool:
        self.objects[key] = bytes(data)
        return True

    async def get(self, key: str, *, byte_range: Any = None, expected_digest: Any = None) -> bytes | None:
        return self.objects.get(key)

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


# -- hazards ---------------------------------------------------------------------------------------------------------


def load_order(m: Model, gpu: Gpu, trials: int) -> tuple[str, str]:
    client = MemoryClient()
    src = m.caches(1)
    writer = m.pipeline(client, src)
    src_ids = list(range(8))
    stored = m.job("w", src_ids)
    start_stores(writer, [stored])
    writer.wait_uploads(60)
    dest = m.caches(2)
    reader = m.pipeline(client, dest)
    bad = 0
    for t in range(trials):
        ids = [64 + 8 * t + i for i in range(8)]
        gpu.busy(0.2)  # the forward pass of the step that allocated the blocks ...
        for layer in dest.values():
            layer[:, ids] = 7.0  # ... then writes them (vLLM zeroes newly allocated blocks)
        start_loads(reader, [m.job(f"r{t}", ids, stored.hashes)])
        got: dict[str, set[int]] = {}
        poll(lambda: bool(got.update(reader.finished_loads()) or got))  # noqa: B023
        gpu.sync()
        bad += got != {f"r{t}": set()} or not all(same_blocks(dest[n], ids, src[n], src_ids) for n in m.names)
    client.close()
    return (FAIL if bad else PASS), f"{bad}/{trials} loads were overwritten by forward work queued before them"


def store_overwrite(m: Model, gpu: Gpu, trials: int) -> tuple[str, str]:
    client = MemoryClient()
    kv = m.caches(3)
    p = m.pipeline(client, kv)
    layers = list(kv.values())
    bad = 0
    for t in range(trials):
        ids = [8 * t + i for i in range(8)]
        gpu.busy(0.2)
        for layer in layers:
            layer[:, ids] = torch.randn(layer[:, ids].shape, device=gpu.device).to(layer.dtype)
        want_blocks = [[layer[:, b].clone() for layer in layers] for b in ids]
        job = m.job(f"s{t}", ids)
        start_stores(p, [job])  # wait_for_save
        before_step(p, [job.req_id] if t % 2 else [])  # handle_preemptions of the next step (odd trials: preempted)
        for layer in layers:
            layer[:, ids] = -3.0  # the next step's forward pass writes the same blocks
        p.wait_uploads(60)
        naming_ = m.naming()
        for h, want in zip(job.hashes, want_blocks, strict=True):
            ref = canonical([w.unsqueeze(1) for w in want], 0)
            bad += client.objects.get(naming_.block(h, 0)) != ref
    client.close()
    return (FAIL if bad else PASS), f"{bad}/{8 * trials} stored blocks hold bytes written after wait_for_save"


def finish_early(m: Model, gpu: Gpu) -> tuple[str, str]:
    client = MemoryClient()
    p = m.pipeline(client, m.caches(4))
    gpu.busy(0.3)
    start_stores(p, [m.job("f", list(range(8)))])
    early = finished_stores(p, {"f"})
    gpu.sync()
    p.wait_uploads(60)
    client.close()
    if gpu.device.type != "cuda":
        return PASS, "dry run: CPU copies are synchronous, nothing to check"
    if early:
        return FAIL, "a request was reported finished while its gather was still queued behind the forward pass"
    return PASS, "finished only after its copies"


def buffer_return(m: Model, gpu: Gpu) -> tuple[str, str]:
    kv = m.caches(5)
    xfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=2, store_buffers=1, load_buffers=1)
    layers = list(kv.values())
    want = canonical(layers, 3)
    blob = bytes(want)
    real, calls = torch.Tensor.index_copy_, [0]

    def failing(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("injected")
        return real(self, dim, index, source)

    for layer in layers:
        layer[:, 9] = 0.0
    gpu.sync()
    gpu.busy(0.3)  # the load stream's copies queue behind this (scatter waits on the current stream)
    torch.Tensor.index_copy_ = failing  # type: ignore[method-assign]
    try:
        xfer.scatter([9], [blob])
    except RuntimeError:
        pass
    finally:
        torch.Tensor.index_copy_ = real  # type: ignore[method-assign]
    buffer = xfer.load_pool.try_acquire()
    if buffer is not None:  # the next user fills the buffer at once
        buffer.view[: len(blob)] = b"\xaa" * len(blob)
        buffer.release()
    gpu.sync()
    if not torch.equal(layers[0][:, 9].view(torch.int16), layers[0][:, 3].view(torch.int16)):
        return FAIL, "a buffer returned on an error path was overwritten while its copy was still queued"
    return PASS, "the buffer came back only after its copy" if buffer is not None else "buffer kept out"


def many_steps(m: Model, gpu: Gpu, steps: int) -> tuple[str, str]:
    """Steps as vLLM runs them: handle_preemptions, forward (writes), start_load_kv, wait_for_save, get_finished.

    Small pools and short kernels keep copies queued across steps; a preempted request's blocks are rewritten by
    the very next forward pass; no host synchronisation in the loop (snapshots are device clones, checked at the end).
    """
    client = MemoryClient()
    kv = m.caches(6)
    p = m.pipeline(client, kv, max_blocks_per_batch=2, store_buffers=2, load_buffers=1)
    layers = list(kv.values())
    naming_ = m.naming()
    fresh = itertools.count()
    written: dict[str, list[torch.Tensor]] = {}  # key -> the block's layers as the forward pass wrote them
    loaded: list[tuple[str, list[torch.Tensor]]] = []  # key -> the block's layers when the load was reported
    loads: dict[str, tuple[BlockJob, BlockJob]] = {}
    prev: BlockJob | None = None
    history: list[BlockJob] = []

    def collect() -> None:
        for req_id, failed in p.finished_loads().items():
            _, load = loads[req_id]
            for b, h in zip(load.block_ids[0], load.hashes, strict=True):
                if b not in failed:  # vLLM's forward pass reads the loaded blocks now
                    loaded.append((naming_.block(h, 0), [layer[:, b : b + 1].clone() for layer in layers]))

    def take(n: int) -> list[int]:
        ids = [next(fresh) for _ in range(n)]
        if ids[-1] >= m.args.num_blocks:
            raise RuntimeError("the model has too few blocks for this many steps")
        return ids

    for step in range(steps):
        preempt = prev is not None and step % 5 == 0
        before_step(p, [prev.req_id] if prev is not None and preempt else [])
        ids = list(prev.block_ids[0]) if prev is not None and preempt else take(4)  # freed blocks are reused at once
        gpu.busy(0.005)
        for layer in layers:
            layer[:, ids] = torch.randn(layer[:, ids].shape, device=gpu.device).to(layer.dtype)
        job = m.job(f"s{step}", ids)
        for b, h in zip(ids, job.hashes, strict=True):
            written[naming_.block(h, 0)] = [layer[:, b : b + 1].clone() for layer in layers]
        if step % 3 == 2 and history:
            old = history[len(history) // 2]
            load = m.job(f"l{step}", take(len(old.hashes)), old.hashes)
            loads[load.req_id] = (old, load)
            start_loads(p, [load])
        start_stores(p, [job])
        collect()
        finished_stores(p, {f"s{step - 2}"})
        history.append(job)
        prev = job
    p.wait_uploads(120)
    poll(lambda: (collect(), not p._loads)[1], limit_s=120)
    gpu.sync()
    wrong = [k for k, v in client.objects.items() if canonical(written[k], 0) != v]
    bad_loads = [k for k, snap in loaded if client.objects.get(k) != canonical(snap, 0)]
    client.close()
    detail = (
        f"{len(wrong)}/{len(client.objects)} stored objects and {len(bad_loads)}/{len(loaded)} loaded blocks differ "
        f"({p.stats.dropped_blocks} stores dropped for want of a buffer)"
    )
    return (FAIL if wrong or bad_loads or not loaded else PASS), detail


def preempt_stall(m: Model, gpu: Gpu) -> tuple[str, str]:
    client = MemoryClient()
    p = m.pipeline(client, m.caches(7))
    before_step(p, [])
    gpu.sync()
    busy = 0.3
    gpu.busy(busy)
    start_stores(p, [m.job("p", list(range(8)))])
    t0 = time.perf_counter()
    before_step(p, [])
    quiet = time.perf_counter() - t0
    t0 = time.perf_counter()
    before_step(p, ["p"])
    preempted = time.perf_counter() - t0
    gpu.sync()
    p.wait_uploads(60)
    client.close()
    detail = (
        f"handle_preemptions {quiet * 1e3:.2f} ms with a {busy * 1e3:.0f} ms forward pass queued "
        f"(ratio {quiet / busy:.3f}); with the request preempted it waited {preempted * 1e3:.1f} ms, as it must"
    )
    return (FAIL if quiet > 0.1 * busy else PASS), detail


# -- layouts ---------------------------------------------------------------------------------------------------------

# vLLM 0.33 vllm/v1/kv_cache_layout.py: logical [L, B, H, N, C] -> memory order. Used when vllm is not importable.
KV_CACHE_LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}


def kv_cache_layouts() -> dict[str, tuple[int, ...]]:
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return KV_CACHE_LAYOUTS
    return {member.name: tuple(member.stride_order) for member in KVCacheLayout}


def layout_mapping() -> Callable[..., tuple[torch.Tensor, KVLayout]] | None:
    """The connector's mapping from vLLM's per-layer view to transfer tensors: issue 12's, else the older one."""
    try:
        from connector.layout import backend_layout, layer_views  # type: ignore[attr-defined]

        def mapped(kv: torch.Tensor, *, name: str, dtype: str, heads: int, block: int, size: int) -> Any:
            layout = backend_layout(
                backend="FLASH_ATTN", kv_cache_layout=name, head_size=size, head_size_v=size, kv_cache_dtype=dtype
            )
            views, kvl = layer_views(kv, layout=layout, num_kv_heads=heads, block_size=block, head_size=size)
            return views[0], kvl

        return mapped
    except ImportError:
        pass
    try:
        from connector.vllm import as_layer_tensor
    except ImportError:
        return None

    def old(kv: torch.Tensor, *, name: str, dtype: str, heads: int, block: int, size: int) -> Any:
        return as_layer_tensor(kv, num_kv_heads=heads, block_size=block)

    return old


def layouts(device: torch.device) -> tuple[str, str]:
    mapping = layout_mapping()
    if mapping is None:
        return SKIP, "no layout mapping importable (connector.vllm needs vllm; issue 12 moves it to connector.layout)"
    cases = []
    for name, order in kv_cache_layouts().items():
        for heads, block, size, dtype in [(8, 16, 64, "auto"), (16, 16, 64, "auto"), (4, 16, 128, "fp8")]:
            cases.append((name, order, heads, block, size, dtype))
    failures = []
    layers, num_blocks = 3, 12
    for name, order, heads, block, size, dtype in cases:
        element = torch.bfloat16 if dtype == "auto" else torch.float8_e4m3fn
        itemsize = torch.empty(0, dtype=element).element_size()
        logical_shape = (layers, num_blocks, heads, block, 2 * size * itemsize)  # [L, B, H, N, C], C = K then V
        raw = torch.randint(0, 256, tuple(logical_shape[i] for i in order), dtype=torch.uint8, device=device)
        logical = raw.view(element).permute(*[order.index(i) for i in range(5)])  # C is innermost in every order
        ids = [num_blocks - 1, 2, 5]
        try:
            views: dict[str, torch.Tensor] = {}
            kvl = KVLayout.NHD
            for i in range(layers):
                views[f"l{i}"], kvl = mapping(logical[i], name=name, dtype=dtype, heads=heads, block=block, size=size)
            xfer = BlockTransfer(kv_caches=views, layout=kvl, max_blocks_per_batch=4, store_buffers=1, load_buffers=1)
            batch = xfer.gather(ids)
            if batch is None:
                raise RuntimeError("no buffer")
            batch.synchronize()
            got = [batch.block_view(i).tobytes() for i in range(len(ids))]
            batch.release()
        except Exception as exc:  # a refusal is a failure of the check, not of the script
            failures.append(f"{name} h{heads} n{block} {dtype}: {type(exc).__name__}: {exc}"[:160])
            continue
        as_bytes = (
            (logical.view(torch.uint8) if itemsize == 1 else logical.contiguous().view(torch.uint8)).cpu().numpy()
        )
        for i, b in enumerate(ids):  # reference: [head][layer][k|v][token][the head's K or V bytes]
            width = size * itemsize
            ref = b"".join(
                as_bytes[layer, b, h, tok, kv * width : (kv + 1) * width].tobytes()
                for h in range(heads)
                for layer in range(layers)
                for kv in range(2)
                for tok in range(block)
            )
            if got[i] != ref:
                failures.append(f"{name} h{heads} n{block} {dtype}: block {b} bytes differ from the reference")
                break
    if failures:
        return FAIL, f"{len(failures)}/{len(cases)} layouts wrong: " + "; ".join(failures[:4])
    return PASS, f"{len(cases)} layouts byte-exact"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strict", action="store_true", help="a skipped hazard is a failure")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--dry-run", action="store_true", help="run the GPU hazards on CPU tensors (checks the script)")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    args.layers, args.heads, args.head_size, args.block_size = 8, 8, 128, 16
    args.num_blocks = 1024 if cuda else 256
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"device={name} torch={torch.__version__} layers={args.layers} heads={args.heads} block={args.block_size}")
    results: list[tuple[str, str, str]] = []

    def check(hazard: str, fn: Callable[[], tuple[str, str]], *, needs_cuda: bool = True) -> None:
        t0 = time.perf_counter()
        if needs_cuda and not cuda and not args.dry_run:
            verdict, detail = SKIP, "needs CUDA"
        else:
            try:
                verdict, detail = fn()
            except Exception as exc:
                verdict, detail = FAIL, f"crashed: {type(exc).__name__}: {exc}"
        results.append((hazard, verdict, detail))
        print(f"{hazard:<16} {verdict}  {detail}  [{time.perf_counter() - t0:.1f}s]", flush=True)

    m = Model(args, device)
    gpu = Gpu(device)
    check("load-order", lambda: load_order(m, gpu, args.trials))
    check("store-overwrite", lambda: store_overwrite(m, gpu, args.trials * 2))
    check("finish-early", lambda: finish_early(m, gpu))
    check("buffer-return", lambda: buffer_return(m, gpu))
    check("many-steps", lambda: many_steps(m, gpu, args.steps))
    check("preempt-stall", lambda: preempt_stall(m, gpu))
    check("layouts", lambda: layouts(device), needs_cuda=False)
    failed = [h for h, v, _ in results if v == FAIL or (v == SKIP and args.strict)]
    print(("FAILED: " + ", ".join(failed)) if failed else "all hazards pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
