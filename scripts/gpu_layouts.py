"""The ``layouts`` check of scripts/gpu_check.py: caches built as vLLM 0.33 declares them (every KVCacheLayout order,
heads == block size, bf16 and fp8), gathered through the connector's layout mapping and compared with canonical bytes
built independently by indexing. It needs no CUDA: on a CPU it checks the same mapping on host tensors."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_harness import FAIL, PASS

from connector.device.transfer import BlockTransfer, KVLayout

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


def layout_mapping() -> Callable[..., tuple[torch.Tensor, KVLayout]]:
    """The connector's mapping from vLLM's per-layer view to transfer tensors (connector/device/layout.py)."""
    from connector.device.layout import backend_layout, layer_views

    def mapped(kv: torch.Tensor, *, name: str, dtype: str, heads: int, block: int, size: int) -> Any:
        layout = backend_layout(
            backend="FLASH_ATTN", kv_cache_layout=name, head_size=size, head_size_v=size, kv_cache_dtype=dtype
        )
        views, kvl = layer_views(kv, layout=layout, num_kv_heads=heads, block_size=block, head_size=size)
        return views[0], kvl

    return mapped


def layouts(device: torch.device) -> tuple[str, str]:
    mapping = layout_mapping()
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
