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

The harness (in-memory client, hooks, model, streams) is scripts/gpu_harness.py; the layouts check is
scripts/gpu_layouts.py. The script also runs against an older checkout (it falls back to the hooks main had), so it
can show "before".
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_harness import (
    FAIL,
    PASS,
    SKIP,
    Gpu,
    MemoryClient,
    Model,
    before_step,
    canonical,
    finished_stores,
    poll,
    same_blocks,
    start_loads,
    start_stores,
)
from gpu_layouts import layouts

from connector.device.transfer import BlockTransfer, KVLayout
from connector.planning.plan import BlockJob

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
