"""Pages laid out as vLLM 0.33 declares them, for backends that cannot run here. Runs in the oracle venv.

    python oracle_layouts.py OUT.json

For each attention backend and each KV-cache layout it supports, builds the per-layer views exactly as vLLM
allocates them (the backend's ``customize_spec``, ``create_kv_cache_views``), writes known K and V through the
split that the backend's own ``forward`` uses, then moves the blocks with ``connector.device.layout.layer_views`` and
``connector.device.transfer.BlockTransfer`` and compares the bytes with the canonical array built from the same K and V.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BLOCKS, LAYERS = 6, 3

# How each backend's forward takes K and V out of a layer's logical [B, H, N, C] view (vLLM 0.33.0 sources), and
# the order of the dims of what it gets: FlashAttention, Triton and Flex index [block, token, head, dim]
# (flash_attn.py:1257, triton_attn.py:828, flex_attention.py:1233: ``kv_cache.transpose(1, 2).split(head_size, -1)``);
# FlashInfer permutes to the physical order and names it NHD or HND (flashinfer.py ~2316-2345).
Split = Callable[[torch.Tensor, int, Any], tuple[torch.Tensor, torch.Tensor, str]]


def _fa(kv: torch.Tensor, hs: int, layout: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
    k, v = kv.transpose(1, 2).split(hs, dim=-1)
    return k, v, "NHD"


def _flashinfer(kv: torch.Tensor, hs: int, layout: Any) -> tuple[torch.Tensor, torch.Tensor, str]:
    from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

    k, v = kv.permute(*layout.layer_view_order).split(hs, dim=-1)
    return k, v, get_flashinfer_layout_string(layout)


SPLITS: dict[str, Split] = {"FLASH_ATTN": _fa, "TRITON_ATTN": _fa, "FLEX_ATTENTION": _fa, "FLASHINFER": _flashinfer}


def views(spec: Any, layout: Any) -> list[torch.Tensor]:
    """One view per layer, as vLLM's allocator makes them for ``layout`` (one dense tensor for all layers)."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, compute_layout_strides, create_kv_cache_views

    strides = compute_layout_strides(spec, BLOCKS, LAYERS, layout)
    size = spec.page_size_bytes * BLOCKS * LAYERS
    names = [f"l{i}" for i in range(LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=strides[0], block_stride=strides[1])
    return create_kv_cache_views(torch.zeros(size, dtype=torch.int8), spec, BLOCKS, layout, tensor)


def check(backend: str, layout: Any, *, heads: int, block: int, hs: int, dtype: torch.dtype) -> dict[str, Any]:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from connector.device.layout import backend_layout, layer_views
    from connector.device.transfer import BlockTransfer

    spec = FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=hs, dtype=dtype)
    try:
        cls = AttentionBackendEnum[backend].get_class()
    except ImportError:
        cls = None  # FlashInfer: customize_spec changes only NVFP4 specs (flashinfer.py, FlashInferBackend)
    spec = cls.customize_spec(spec) if hasattr(cls, "customize_spec") else spec
    dense = all(getattr(spec, f, None) is None for f in ("num_head_slots", "state_content_bytes", "page_size_padded"))
    mapping = backend_layout(
        backend=backend, kv_cache_layout=layout.name, head_size=hs, head_size_v=spec.head_size_v, dense_page=dense
    )
    kv_views = views(spec, layout)
    torch.manual_seed(0)
    want = torch.randn(BLOCKS, heads, LAYERS, 2, block, hs).to(dtype)  # canonical (block, head, layer, k|v, t, d)
    for layer, kv in enumerate(kv_views):
        k, v, order = SPLITS[backend](kv, hs, layout)
        for s, dest in ((0, k), (1, v)):
            src = want[:, :, layer, s]  # (block, head, token, dim)
            dest.copy_(src if order == "HND" else src.transpose(1, 2))
    caches: dict[str, torch.Tensor] = {}
    kv_layout = None
    for layer, kv in enumerate(kv_views):
        parts, kv_layout = layer_views(kv, layout=mapping, num_kv_heads=heads, block_size=block, head_size=hs)
        caches.update({f"l{layer}#{i}": p for i, p in enumerate(parts)})
    assert kv_layout is not None
    xfer = BlockTransfer(
        kv_caches=caches, layout=kv_layout, max_blocks_per_batch=BLOCKS, store_buffers=1, load_buffers=1
    )
    ids = [4, 0, 5]
    batch = xfer.gather(ids)
    assert batch is not None
    batch.synchronize()
    equal = all(
        bytes(batch.block_view(i)) == want[b].contiguous().view(torch.uint8).numpy().tobytes()
        for i, b in enumerate(ids)
    )
    batch.release()
    return {
        "backend": backend,
        "layout": layout.name,
        "heads": heads,
        "block": block,
        "dense": dense,
        "certified": mapping.certified,
        "equal": equal,
    }


def main() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE, _FLASHINFER_LAYOUT_NAMES

    results: list[dict[str, Any]] = []
    for backend in SPLITS:
        try:
            layouts = AttentionBackendEnum[backend].get_class().supported_kv_cache_layouts()
        except ImportError as exc:  # FlashInfer needs its wheel: its declared layouts and spec are from its source
            results.append({"backend": backend, "import_error": f"{type(exc).__name__}: {exc}"})
            layouts = None
        for layout in layouts or _DEFAULT_LAYOUT_PREFERENCE:
            if backend == "FLASHINFER" and layout.name not in _FLASHINFER_LAYOUT_NAMES:
                continue  # FlashInfer refuses layouts it has no name for (utils.get_flashinfer_layout_string)
            for heads, block in ((4, 16), (16, 16)):  # 16 heads == 16 tokens: the case shapes cannot tell apart
                results.append(check(backend, layout, heads=heads, block=block, hs=64, dtype=torch.float16))
    Path(sys.argv[1]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
