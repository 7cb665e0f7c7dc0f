"""The canonical layout's arithmetic, checked against numpy's own C-order offsets of the canonical array."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from connector.device import layout
from connector.device.layout import (
    BlockGeometry,
    head_byte_range,
    heads_of,
    local_geometry,
    rank_byte_range,
)
from contract import keys as protocol
from contract import wire

GEOM = BlockGeometry(num_layers=4, num_kv_heads=8, head_size=128, block_size=16, itemsize=2)


def canonical_head_labels(g: BlockGeometry) -> np.ndarray:
    """A canonical block (itemsize 2) whose every element holds its head index, as raw bytes."""
    arr = np.empty(g.shape, dtype="<u2")
    for h in range(g.num_kv_heads):
        arr[h] = h
    return np.frombuffer(arr.tobytes(), dtype=np.uint8)


def test_sizes() -> None:
    assert GEOM.bytes_per_head == 4 * 2 * 16 * 128 * 2 == 32768
    assert GEOM.block_bytes == 8 * 32768
    assert GEOM.block_bytes == int(np.prod(GEOM.shape)) * GEOM.itemsize
    assert layout.CANONICAL_FORMAT is protocol.CANONICAL_FORMAT == "kvgate-v1-hnd"


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_geometry_rejects_non_positive_ints(bad: object) -> None:
    with pytest.raises(ValueError):
        BlockGeometry(num_layers=4, num_kv_heads=8, head_size=128, block_size=16, itemsize=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_heads_partition_the_model(tp_size: int) -> None:
    seen: list[int] = []
    for rank in range(tp_size):
        heads = heads_of(tp_size=tp_size, rank=rank, num_kv_heads=8)
        assert heads.step == 1 and len(heads) == 8 // tp_size
        seen.extend(heads)
    assert seen == list(range(8))


@pytest.mark.parametrize(("tp_size", "rank", "heads"), [(3, 0, 8), (16, 0, 8), (4, 4, 8), (4, -1, 8), (0, 0, 8)])
def test_heads_of_rejects(tp_size: int, rank: int, heads: int) -> None:
    with pytest.raises(ValueError):
        heads_of(tp_size=tp_size, rank=rank, num_kv_heads=heads)


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_rank_range_holds_exactly_the_ranks_heads(tp_size: int) -> None:
    blob = canonical_head_labels(GEOM)
    ends = 0
    for rank in range(tp_size):
        start, end = rank_byte_range(GEOM, tp_size=tp_size, rank=rank)
        assert start == ends  # contiguous, in rank order, no gaps
        ends = end
        labels = np.frombuffer(blob[start:end].tobytes(), dtype="<u2")
        assert sorted(set(labels.tolist())) == list(heads_of(tp_size=tp_size, rank=rank, num_kv_heads=8))
    assert ends == GEOM.block_bytes == blob.size


def test_head_byte_range_matches_numpy_offsets() -> None:
    arr = np.zeros(GEOM.shape, dtype="<u2")
    for h in (0, 3, 7):
        start, end = head_byte_range(GEOM, heads=range(h, h + 1))
        assert start == arr[h].ctypes.data - arr.ctypes.data
        assert end - start == arr[h].nbytes
    with pytest.raises(ValueError):
        head_byte_range(GEOM, heads=range(6, 9))
    with pytest.raises(ValueError):
        head_byte_range(GEOM, heads=range(0, 4, 2))


def test_local_geometry() -> None:
    local = local_geometry(GEOM, tp_size=4)
    assert local.num_kv_heads == 2
    assert local.block_bytes * 4 == GEOM.block_bytes
    assert (local.num_layers, local.head_size, local.block_size, local.itemsize) == (4, 128, 16, 2)
    with pytest.raises(ValueError):
        local_geometry(GEOM, tp_size=3)


def test_headers() -> None:
    start, end = rank_byte_range(GEOM, tp_size=4, rank=1)
    assert wire.format_content_range(start=start, end=end, total=GEOM.block_bytes) == "bytes 65536-131071/262144"
    assert wire.format_range(start=start, end=end) == "bytes=65536-131071"
    assert wire.format_content_range(start=0, end=1, total=1) == "bytes 0-0/1"
    for bad in [(5, 5, 10), (-1, 3, 10), (0, 11, 10)]:
        with pytest.raises(ValueError):
            wire.format_content_range(start=bad[0], end=bad[1], total=bad[2])
    with pytest.raises(ValueError):
        wire.format_range(start=3, end=2)


# --- per-backend page layouts (connector.device.layout.backend_layout / layer_views) ----------------------------------

import torch  # noqa: E402  (a test dependency: a missing torch is a broken install, not a skip)

from connector.device.layout import (  # noqa: E402
    BackendLayout,
    LayoutError,
    PageFormat,
    backend_layout,
    layer_views,
)
from connector.device.transfer import BlockTransfer  # noqa: E402
from contract.keys import KVGroup  # noqa: E402
from contract.keys import naming as run_naming  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
B, LAYERS, BS, D = 5, 2, 32, 32


def cpu_vec_page(kv: torch.Tensor) -> torch.Tensor:
    """A CPU_ATTN layer page as its "vec" kernels write it (csrc/cpu/cpu_attn_vec.hpp ``reshape_and_cache``): per
    (block, head) K column-major ``[head_dim][token]`` then V row-major ``[token][head_dim]``, seen through the
    logical ``[block, head, token, 2 * head_dim]`` view vLLM registers. ``kv``: ``(block, head, k|v, token, dim)``."""
    b, h, _, n, d = kv.shape
    page = torch.cat([kv[:, :, 0].transpose(2, 3).reshape(b, h, n * d), kv[:, :, 1].reshape(b, h, n * d)], dim=2)
    return page.view(b, h, n, 2 * d)


def model_kv(heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(block, head, layer, k|v, token, dim)``: the canonical order, with every element distinct."""
    n = B * heads * LAYERS * 2 * BS * D
    return torch.arange(n, dtype=torch.float32).reshape(B, heads, LAYERS, 2, BS, D).to(dtype)


def gather_bytes(caches: dict[str, torch.Tensor], layout_kind: object, ids: list[int]) -> list[bytes]:
    xfer = BlockTransfer(kv_caches=caches, layout=layout_kind, max_blocks_per_batch=B, store_buffers=1, load_buffers=1)  # type: ignore[arg-type]
    batch = xfer.gather(ids)
    assert batch is not None
    batch.synchronize()
    out = [bytes(batch.block_view(i)) for i in range(len(ids))]
    batch.release()
    return out


def registered(pages: list[torch.Tensor], layout: BackendLayout, heads: int) -> tuple[dict[str, torch.Tensor], object]:
    caches: dict[str, torch.Tensor] = {}
    kind = None
    for layer, page in enumerate(pages):
        views, kind = layer_views(page, layout=layout, num_kv_heads=heads, block_size=BS, head_size=D)
        caches.update({f"l{layer}#{i}": v for i, v in enumerate(views)})
    return caches, kind


CPU_VEC = backend_layout(backend="CPU_ATTN", kv_cache_layout="LBHNC", head_size=D, head_size_v=D, cpu_isa="vec")


def test_cpu_vec_page_is_canonical_and_scatters_back() -> None:
    """Fails on the code before the per-backend layouts: it read the CPU page's content axis as K|V per token."""
    kv = model_kv(heads=2)
    pages = [cpu_vec_page(kv[:, :, layer]) for layer in range(LAYERS)]
    caches, kind = registered(pages, CPU_VEC, heads=2)
    ids = [3, 0, 4]
    got = gather_bytes(caches, kind, ids)
    assert got == [kv[b].contiguous().numpy().tobytes() for b in ids]
    fresh = [torch.zeros_like(p) for p in pages]
    fresh_caches, _ = registered(fresh, CPU_VEC, heads=2)
    xfer = BlockTransfer(kv_caches=fresh_caches, layout=kind, max_blocks_per_batch=B, store_buffers=1, load_buffers=1)  # type: ignore[arg-type]
    xfer.scatter(ids, got).synchronize()
    for page, back in zip(pages, fresh, strict=True):
        assert torch.equal(back[ids], page[ids])  # the loader's page is the kernel's page, byte for byte
        assert not back[[1, 2]].any()


@pytest.mark.parametrize("heads", [2, BS])  # BS heads == block size: shapes alone cannot tell NHD from HND
@pytest.mark.parametrize("physical", ["HND", "NHD"])
def test_dense_page_any_stride_order(heads: int, physical: str) -> None:
    """A dense page (FlashAttention & co.): logical [block, head, token, K|V], memory in either order."""
    kv = model_kv(heads=heads, dtype=torch.bfloat16)
    layout = backend_layout(backend="FLASH_ATTN", kv_cache_layout="LBNHC", head_size=D, head_size_v=D)
    assert layout.page is PageFormat.KV_CONTENT and layout.certified
    pages = []
    for layer in range(LAYERS):
        logical = kv[:, :, layer].permute(0, 1, 3, 2, 4).reshape(B, heads, BS, 2 * D)  # [b, h, t, k|v dims]
        if physical == "NHD":
            logical = logical.transpose(1, 2).contiguous().transpose(1, 2)  # memory [b, t, h, c], same logic
        pages.append(logical)
    caches, kind = registered(pages, layout, heads=heads)
    got = gather_bytes(caches, kind, [1, 4])
    assert got == [kv[b].contiguous().view(torch.uint8).numpy().tobytes() for b in (1, 4)]


def test_layer_views_refuses_what_vllm_did_not_declare() -> None:
    page = torch.zeros(B, 2, BS, 2 * D)
    with pytest.raises(LayoutError):
        layer_views(page, layout=CPU_VEC, num_kv_heads=4, block_size=BS, head_size=D)
    with pytest.raises(LayoutError):
        layer_views(page.transpose(1, 2).contiguous(), layout=CPU_VEC, num_kv_heads=2, block_size=BS, head_size=D)
    nhd_memory = page.transpose(1, 2).contiguous().transpose(1, 2)  # right logical shape, tokens outside heads
    with pytest.raises(LayoutError):  # the CPU kernels need each (block, head) page contiguous
        layer_views(nhd_memory, layout=CPU_VEC, num_kv_heads=2, block_size=BS, head_size=D)


@pytest.mark.parametrize(
    ("kw", "page", "layout_id"),
    [
        ({"backend": "CPU_ATTN", "cpu_isa": "vec"}, PageFormat.CPU_KT, "CPU_ATTN/LBHNC/vec"),
        ({"backend": "CPU_ATTN", "cpu_isa": "amx"}, PageFormat.RAW, "CPU_ATTN/LBHNC/amx/auto"),
        ({"backend": "FLASH_ATTN"}, PageFormat.KV_CONTENT, "FLASH_ATTN/LBHNC"),
        ({"backend": "FLASHINFER"}, PageFormat.KV_CONTENT, "FLASHINFER/LBHNC"),
        ({"backend": "FLASH_ATTN", "kv_cache_dtype": "fp8"}, PageFormat.RAW, "FLASH_ATTN/LBHNC/fp8/quantized"),
        ({"backend": "TRITON_ATTN", "dense_page": False}, PageFormat.RAW, "TRITON_ATTN/LBHNC/auto/packed"),
        ({"backend": "FLASH_ATTN_DIFFKV", "head_size_v": 16}, PageFormat.RAW, "FLASH_ATTN_DIFFKV/LBHNC/auto/k32v16"),
        ({"backend": "ROCM_ATTN"}, PageFormat.RAW, "ROCM_ATTN/LBHNC/auto"),
    ],
)
def test_backend_layout_table(kw: dict[str, object], page: PageFormat, layout_id: str) -> None:
    args: dict[str, object] = {"kv_cache_layout": "LBHNC", "head_size": D, "head_size_v": D, **kw}
    layout = backend_layout(**args)  # type: ignore[arg-type]
    assert layout.page is page
    assert layout.layout_id == layout_id


def test_uncertified_layout_names_its_own_per_rank_namespace() -> None:
    group = (KVGroup(tokens_per_block=BS, layer_names=("a", "b")),)
    common = {"model_name": "m", "tokens_per_hash": BS, "dtype": "bfloat16", "groups": group, "total_kv_heads": 8}
    canonical = run_naming(tp_size=2, rank=1, num_kv_heads=4, block_bytes=1234, **common)  # type: ignore[arg-type]
    assert canonical.parallel_agnostic and canonical.rank == 0
    assert canonical.fields["canonical_format"] == "kvgate-v1-hnd" and canonical.fields["block_bytes"] == 1234
    amx = run_naming(tp_size=2, rank=1, num_kv_heads=4, kv_layout="CPU_ATTN/LBHNC/amx/auto", **common)  # type: ignore[arg-type]
    other = run_naming(tp_size=2, rank=1, num_kv_heads=4, kv_layout="ROCM_ATTN/LBHNC/auto", **common)  # type: ignore[arg-type]
    assert not amx.parallel_agnostic and amx.rank == 1 and "canonical_format" not in amx.fields
    assert amx.fields["kv_layout"] == "CPU_ATTN/LBHNC/amx/auto"
    assert len({canonical.namespace, amx.namespace, other.namespace}) == 3
    legacy = run_naming(tp_size=2, rank=1, num_kv_heads=4, **common)  # type: ignore[arg-type]
    assert "block_bytes" not in legacy.fields and "kv_layout" not in legacy.fields  # old digests unchanged


@pytest.mark.vllm
def test_gpu_backend_pages_as_vllm_033_declares_them(vllm_python: str, tmp_path: Path) -> None:
    """Every full-attention GPU backend kvgate certifies, in every KV-cache layout it supports, built by vLLM 0.33's
    own allocator (oracle venv): kvgate's canonical bytes equal the K/V written through the backend's own split."""
    out = tmp_path / "layouts.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    script = REPO / "tests" / "engine" / "oracle_layouts.py"
    subprocess.run([vllm_python, str(script), str(out)], check=True, env=env, cwd=REPO, timeout=600)
    results = json.loads(out.read_text())
    checked = [r for r in results if "equal" in r]
    assert {r["backend"] for r in checked} == {"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "FLASHINFER"}
    assert {r["heads"] for r in checked} == {4, 16}  # 16 heads == 16 tokens per block included
    for r in checked:
        assert r["dense"] and r["certified"] and r["equal"], r
    assert len({(r["backend"], r["layout"]) for r in checked}) >= 13


def test_a_gather_copies_the_blocks_it_stores_not_the_cache() -> None:
    """Fails on the code before: ``index_select`` on the CPU page's strided K view made each whole layer
    contiguous first (CPU torch), so storing one block of a 1 GiB cache copied the cache: 0.85-0.9 s of the engine's
    step in ``wait_for_save`` under ``vllm serve``, before the first token of a hit that stores a new block."""
    blocks, heads = 512, 2
    pages = [cpu_vec_page(torch.zeros(blocks, heads, 2, BS, D)) for _ in range(LAYERS)]
    caches, kind = registered(pages, CPU_VEC, heads=heads)
    xfer = BlockTransfer(kv_caches=caches, layout=kind, max_blocks_per_batch=B, store_buffers=1, load_buffers=1)  # type: ignore[arg-type]
    block_bytes = LAYERS * heads * 2 * BS * D * 4
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        batch = xfer.gather([7])
        assert batch is not None
        batch.synchronize()
    batch.release()
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    cache_bytes = blocks * block_bytes
    assert allocated <= 4 * block_bytes, (
        f"one gather allocated {allocated} bytes ({allocated / cache_bytes:.2f}x the cache)"
    )
