"""Gather/scatter on CPU tensors (the same code path CUDA runs), checked byte for byte.

References are built from the model's per-layer KV by explicit loops over [head][layer][k|v][token], independent
of the implementation's permutes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import pytest
import torch

from connector.device.layout import BlockGeometry, head_byte_range, heads_of, rank_byte_range
from connector.device.transfer import BlockTransfer, KVLayout, PoolExhausted, one_copy_thread

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 4, 8, 128, 16, 10
DTYPES = [torch.bfloat16, torch.float16]
LAYOUTS = [KVLayout.NHD, KVLayout.HND]


def model_kv(dtype: torch.dtype, *, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs and all), logical ``(layer, k|v, block, token, head, dim)``."""
    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (LAYERS, 2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE), generator=gen)
    return bits.to(torch.int16).view(dtype)


def layer_tensors(kv: torch.Tensor, layout: KVLayout, heads: range | None = None) -> dict[str, torch.Tensor]:
    """vLLM-registered tensors of (a head shard of) the model, each contiguous in its layout."""
    if heads is not None:
        kv = kv[:, :, :, :, heads.start : heads.stop]
    out = {}
    for layer in range(kv.shape[0]):
        t = kv[layer]  # (2, blocks, token, head, dim)
        out[f"model.layers.{layer}.self_attn"] = (t if layout is KVLayout.NHD else t.permute(0, 1, 3, 2, 4)).clone(
            memory_format=torch.contiguous_format
        )
    return out


def zeros_like(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: torch.zeros_like(t) for name, t in caches.items()}


def reference_block(kv: torch.Tensor, block: int, heads: range | None = None) -> bytes:
    rows = []
    for h in heads if heads is not None else range(kv.shape[4]):
        for layer in range(kv.shape[0]):
            for k_or_v in range(2):
                for token in range(BLOCK):
                    rows.append(kv[layer, k_or_v, block, token, h])
    return torch.stack(rows).view(torch.int16).numpy().tobytes()


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def make(caches: dict[str, torch.Tensor], layout: KVLayout, **kw: int) -> BlockTransfer:
    opts = {"max_blocks_per_batch": 4, "store_buffers": 2, "load_buffers": 2} | kw
    return BlockTransfer(kv_caches=caches, layout=layout, **opts)


async def until(cond: Callable[[], bool], *, timeout_s: float = 5.0) -> None:
    """Poll ``cond`` on the loop (other tasks run between polls) until it holds; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.001)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gather_is_canonical_and_scatter_restores(dtype: torch.dtype, layout: KVLayout) -> None:
    kv = model_kv(dtype)
    caches = layer_tensors(kv, layout)
    xfer = make(caches, layout)
    g = xfer.geometry
    assert g == BlockGeometry(num_layers=4, num_kv_heads=8, head_size=128, block_size=16, itemsize=2)
    ids = [7, 2, 9, 0]
    batch = xfer.gather(ids)
    assert batch is not None
    batch.synchronize()
    assert batch.done()
    blobs = []
    for i, b in enumerate(ids):
        view = batch.block_view(i)
        assert view.readonly and view.nbytes == g.block_bytes
        assert view.tobytes() == reference_block(kv, b), f"block {b}"
        blobs.append(view.tobytes())
    batch.release()

    fresh = zeros_like(caches)
    dest = [1, 3, 4, 8]  # loaded under other ids: block ids are per-node
    load = make(fresh, layout).scatter(dest, blobs)
    load.synchronize()
    for name in caches:
        for src, dst in zip(ids, dest, strict=True):
            assert torch.equal(as_bytes(fresh[name][:, dst]), as_bytes(caches[name][:, src])), (name, dst)
        untouched = [b for b in range(NUM_BLOCKS) if b not in dest]
        assert not fresh[name][:, untouched].view(torch.uint8).any()
    load.release()


def test_strided_layer_tensors() -> None:
    """vLLM's HND stride order keeps the NHD logical shape: ``layout`` names dims, memory order is free."""
    kv = model_kv(torch.bfloat16, seed=3)
    hnd_memory = layer_tensors(kv, KVLayout.HND)
    logical_nhd = {n: t.permute(0, 1, 3, 2, 4) for n, t in hnd_memory.items()}
    assert not next(iter(logical_nhd.values())).is_contiguous()
    xfer = make(logical_nhd, KVLayout.NHD)
    batch = xfer.gather([5])
    assert batch is not None
    assert batch.block_view(0).tobytes() == reference_block(kv, 5)
    fresh = {n: torch.zeros_like(t).permute(0, 1, 3, 2, 4) for n, t in hnd_memory.items()}
    make(fresh, KVLayout.NHD).scatter([6], [batch.block_view(0)]).synchronize()
    for name in fresh:
        assert torch.equal(as_bytes(fresh[name][:, 6]), as_bytes(logical_nhd[name][:, 5]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cross_tp_parts_are_byte_ranges_of_the_tp1_block(layout: KVLayout) -> None:
    kv = model_kv(torch.bfloat16, seed=1)
    ids = [3, 8]
    full_batch = make(layer_tensors(kv, layout), layout).gather(ids)
    assert full_batch is not None
    full = [full_batch.block_view(i).tobytes() for i in range(len(ids))]
    geometry = BlockGeometry(num_layers=LAYERS, num_kv_heads=HEADS, head_size=HEAD_SIZE, block_size=BLOCK, itemsize=2)

    parts: list[list[bytes]] = [[] for _ in ids]
    for rank in range(4):
        shard = make(layer_tensors(kv, layout, heads_of(tp_size=4, rank=rank, num_kv_heads=HEADS)), layout)
        start, end = rank_byte_range(geometry, tp_size=4, rank=rank)
        assert shard.block_bytes() == end - start
        batch = shard.gather(ids)
        assert batch is not None
        for i in range(len(ids)):
            got = batch.block_view(i).tobytes()
            assert got == full[i][start:end], (rank, i)
            parts[i].append(got)
    assert [b"".join(p) for p in parts] == full

    for rank in range(2):  # a TP=2 reader loads only its byte range and gets exactly its shard
        heads = heads_of(tp_size=2, rank=rank, num_kv_heads=HEADS)
        want = layer_tensors(kv, layout, heads)
        loaded = zeros_like(want)
        start, end = rank_byte_range(geometry, tp_size=2, rank=rank)
        make(loaded, layout).scatter([0, 9], [blob[start:end] for blob in full]).synchronize()
        for name in want:
            assert torch.equal(as_bytes(loaded[name][:, 0]), as_bytes(want[name][:, 3]))
            assert torch.equal(as_bytes(loaded[name][:, 9]), as_bytes(want[name][:, 8]))
            assert not loaded[name][:, 1:9].view(torch.uint8).any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_slice(layout: KVLayout) -> None:
    kv = model_kv(torch.float16, seed=2)
    caches = layer_tensors(kv, layout)
    xfer = make(caches, layout)
    heads = range(2, 5)
    batch = xfer.gather([4], heads=heads)
    assert batch is not None
    start, end = head_byte_range(xfer.geometry, heads=heads)
    assert batch.block_view(0).tobytes() == reference_block(kv, 4)[start:end] == reference_block(kv, 4, heads)
    fresh = zeros_like(caches)
    make(fresh, layout).scatter([4], [batch.block_view(0)], heads=heads).synchronize()
    head_dim = 3 if layout is KVLayout.NHD else 2
    for name in caches:
        got, src = fresh[name][:, 4], caches[name][:, 4]
        for h in range(HEADS):
            a, b = got.select(head_dim - 1, h), src.select(head_dim - 1, h)
            assert torch.equal(as_bytes(a), as_bytes(b)) if h in heads else not a.view(torch.uint8).any()
    with pytest.raises(ValueError):
        xfer.gather([4], heads=range(6, 9))


def test_store_pool_exhaustion_and_reuse() -> None:
    kv = model_kv(torch.bfloat16, seed=4)
    xfer = make(layer_tensors(kv, KVLayout.NHD), KVLayout.NHD, store_buffers=2)
    first, second = xfer.gather([0]), xfer.gather([1])
    assert first is not None and second is not None
    assert xfer.gather([2]) is None  # exhausted: a value, the caller drops the store
    assert xfer.store_pool.available == 0
    first.release()
    first.release()  # idempotent
    with pytest.raises(RuntimeError):
        first.block_view(0)
    third = xfer.gather([2])
    assert third is not None
    assert third.block_view(0).tobytes() == reference_block(kv, 2)  # the reused buffer holds the new block
    assert second.block_view(0).tobytes() == reference_block(kv, 1)
    with second, third:
        pass
    assert xfer.store_pool.available == 2
    buf = xfer.store_pool.try_acquire()
    assert buf is not None
    buf.release()
    assert xfer.store_pool.try_acquire() is buf
    with pytest.raises(RuntimeError):
        buf.release()
        buf.release()


def test_gather_many_splits_and_marks_drops() -> None:
    kv = model_kv(torch.bfloat16, seed=5)
    xfer = make(layer_tensors(kv, KVLayout.HND), KVLayout.HND, max_blocks_per_batch=2, store_buffers=2)
    ids = [9, 1, 4, 6, 2]
    batches = xfer.gather_many(ids)
    assert len(batches) == 3 and batches[2] is None
    got = [b.block_view(i).tobytes() for b in batches if b is not None for i in range(len(b))]
    assert got == [reference_block(kv, b) for b in ids[:4]]


def test_scatter_rejects_bad_input_and_keeps_the_pool() -> None:
    kv = model_kv(torch.bfloat16, seed=6)
    xfer = make(layer_tensors(kv, KVLayout.NHD), KVLayout.NHD, load_buffers=1)
    blob = reference_block(kv, 0)
    for ids, data in [([0, 0], [blob, blob]), ([10], [blob]), ([1], [blob[:-1]]), ([1, 2], [blob]), ([], [])]:
        with pytest.raises(ValueError):
            xfer.scatter(ids, data)
    with pytest.raises(ValueError):
        xfer.gather([0, 1, 2, 3, 4])  # more than max_blocks_per_batch
    assert xfer.load_pool.available == 1
    held = xfer.load_pool.try_acquire()
    with pytest.raises(PoolExhausted):
        xfer.scatter([1], [blob])
    assert held is not None
    held.view[: len(blob)] = blob  # a buffer filled in place, e.g. straight from the HTTP body
    xfer.scatter([5], None, buffer=held).release()
    assert xfer.load_pool.available == 1
    assert torch.equal(as_bytes(xfer._layers[0][:, 5]), as_bytes(xfer._layers[0][:, 0]))


async def test_async_scatter_many_splits_over_a_single_buffer() -> None:
    kv = model_kv(torch.bfloat16, seed=7)
    src = layer_tensors(kv, KVLayout.HND)
    blobs = [reference_block(kv, b) for b in range(7)]
    fresh = zeros_like(src)
    xfer = make(fresh, KVLayout.HND, max_blocks_per_batch=2, load_buffers=1)
    handle = await asyncio.wait_for(xfer.scatter_many(list(range(7)), blobs), timeout=5)
    await handle.wait()
    assert handle.done() and xfer.load_pool.available == 1
    for name in src:
        assert torch.equal(as_bytes(fresh[name][:, :7]), as_bytes(src[name][:, :7]))
        assert not fresh[name][:, 7:].view(torch.uint8).any()
    batch = make(src, KVLayout.HND).gather([3])
    assert batch is not None
    await batch.wait()
    assert batch.block_view(0).tobytes() == blobs[3]


async def test_pool_acquire_waits_for_a_release_from_another_thread() -> None:
    kv = model_kv(torch.bfloat16)
    pool = make(layer_tensors(kv, KVLayout.NHD), KVLayout.NHD, load_buffers=1).load_pool
    held = pool.try_acquire()
    assert held is not None
    cancelled = asyncio.create_task(pool.acquire())
    waiter = asyncio.create_task(pool.acquire())
    await until(lambda: len(pool._waiters) == 2)  # both queued behind the held buffer
    assert not waiter.done()
    cancelled.cancel()
    threading.Thread(target=held.release).start()
    assert await asyncio.wait_for(waiter, timeout=5) is held  # handed past the cancelled waiter
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    held.release()
    assert pool.available == 1


async def test_buffer_handed_to_a_waiter_cancelled_meanwhile_comes_back() -> None:
    pool = make(layer_tensors(model_kv(torch.bfloat16), KVLayout.NHD), KVLayout.NHD, load_buffers=1).load_pool
    held = pool.try_acquire()
    assert held is not None
    waiter = asyncio.create_task(pool.acquire())
    await until(lambda: len(pool._waiters) == 1)
    held.release()  # hand-over queued on the loop ...
    waiter.cancel()  # ... and the waiter goes away before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await until(lambda: pool.available == 1)  # the buffer came back to the pool


@pytest.mark.parametrize(("dtype", "head_size"), [(torch.float8_e4m3fn, 5), (torch.float16, 3), (torch.float32, 1)])
def test_odd_rows_fall_back_to_narrower_words(dtype: torch.dtype, head_size: int) -> None:
    gen = torch.Generator().manual_seed(8)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shape = (2, 6, 4, 3, head_size * itemsize)  # HND: (2, blocks, heads, tokens, bytes)
    caches = {f"l{i}": torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype) for i in range(2)}
    xfer = BlockTransfer(kv_caches=caches, layout=KVLayout.HND, max_blocks_per_batch=2, store_buffers=1, load_buffers=1)
    assert xfer.geometry.block_size == 3 and xfer.geometry.head_size == head_size
    batch = xfer.gather([4, 1])
    assert batch is not None
    for i, b in enumerate([4, 1]):
        ref = torch.stack([caches[f"l{layer}"].view(torch.uint8)[:, b, h] for h in range(4) for layer in range(2)])
        assert batch.block_view(i).tobytes() == ref.numpy().tobytes()
    fresh = zeros_like(caches)
    make(fresh, KVLayout.HND, max_blocks_per_batch=2).scatter([0, 5], [batch.block_view(0), batch.block_view(1)])
    for name in caches:
        assert torch.equal(as_bytes(fresh[name][:, [0, 5]]), as_bytes(caches[name][:, [4, 1]]))
        assert not fresh[name][:, 1:5].view(torch.uint8).any()


def test_cpu_copies_run_on_one_thread_and_the_setting_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each layer's copy would be one of torch's parallel regions; on shared cores they wait for the slowest thread
    (store 0.3x of a raw PUT with one busy process beside, benchmarks.connector.pipeline --busy 1), so CPU copies
    run on the calling thread alone, and the caller's thread count comes back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: list[int] = []
    copy, index_copy = torch.Tensor.copy_, torch.Tensor.index_copy_

    def spy_gather(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return copy(self, *a, **k)  # type: ignore[arg-type]

    def spy_copy(self: torch.Tensor, *a: object, **k: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return index_copy(self, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.Tensor, "copy_", spy_gather)  # a gather's copy into the staging view, per layer
    monkeypatch.setattr(torch.Tensor, "index_copy_", spy_copy)
    try:
        caches = layer_tensors(model_kv(torch.bfloat16), KVLayout.NHD)
        xfer = make(caches, KVLayout.NHD)
        batch = xfer.gather([1, 2])
        assert batch is not None
        blobs = [batch.block_view(i).tobytes() for i in range(2)]
        batch.release()
        assert torch.get_num_threads() == 2
        xfer.scatter([3, 4], blobs).release()
        assert torch.get_num_threads() == 2
        assert len(seen) == 2 * LAYERS and set(seen) == {1}
    finally:
        torch.set_num_threads(before)


def test_one_copy_thread_leaves_a_replaced_set_num_threads_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker replaces torch.set_num_threads with a stub that only logs a warning: a copy must not call it
    (two warnings per copy, hundreds per load); torch's own is used and the caller's setting restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with one_copy_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        calls: list[int] = []

        def stub(n: int) -> None:  # as vLLM's CPU worker installs
            calls.append(n)

        monkeypatch.setattr(torch, "set_num_threads", stub)
        with one_copy_thread():
            assert torch.get_num_threads() == 2
        assert calls == []
    finally:
        monkeypatch.undo()
        torch.set_num_threads(threads)
