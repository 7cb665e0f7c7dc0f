"""The vLLM side of ``connector.device.layout``: which attention backend, spec, KV-cache layout setting and CPU ISA a
run has, read from vLLM's own config and layers, never from tensor shapes. Imports vllm lazily (connector.vllm uses
it)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from connector.device.layout import BackendLayout, LayoutError, backend_layout
from contract.keys import KVGroup

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("kvgate.connector.vllm")


def attention_backend_name(vllm_config: VllmConfig, spec: Any) -> str:
    """The attention backend vLLM picks for a group's layers, computed the same way in every process."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import get_attn_backend

    chosen = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if chosen is not None:
        return str(chosen.name)
    if current_platform.is_cpu():
        return "CPU_ATTN"
    try:
        with set_current_vllm_config(vllm_config):
            model, cache = vllm_config.model_config, vllm_config.cache_config
            backend = get_attn_backend(spec.head_size, model.dtype, cache.cache_dtype)
    except Exception as exc:  # then the pages are kept as they are, per rank, under an "unknown" layout id
        log.warning("kvgate: cannot tell the attention backend (%s): its layout is not certified", exc)
        return "unknown"
    return str(backend.get_name())


def resolve_layout(vllm_config: VllmConfig, spec: Any) -> BackendLayout:
    """The page layout of the first group, from vLLM's declarations (backend, spec, KV-cache layout, CPU ISA)."""
    cache = vllm_config.cache_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if spec is None or not isinstance(spec, FullAttentionSpec):
        return backend_layout(backend="none", kv_cache_layout="", head_size=0, head_size_v=1)
    backend = attention_backend_name(vllm_config, spec)
    isa = None
    if backend == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, spec.block_size, spec.head_size, cache.cache_dtype)
    dense = all(getattr(spec, f, None) is None for f in ("num_head_slots", "state_content_bytes", "page_size_padded"))
    return backend_layout(
        backend=backend,
        kv_cache_layout=str(cache.kv_cache_layout or ""),
        head_size=spec.head_size,
        head_size_v=getattr(spec, "head_size_v", None) or spec.head_size,
        kv_cache_dtype=str(cache.cache_dtype),
        dense_page=dense,
        cpu_isa=isa,
    )


def check_layers(vllm_config: VllmConfig, *, groups: Sequence[KVGroup], layout: BackendLayout) -> None:
    """The layers' real backend (and CPU ISA) must be the ones the namespace was named after."""
    context = vllm_config.compilation_config.static_forward_context
    for group in groups:
        for name in group.layer_names:
            layer = context.get(name)
            backend = getattr(layer, "attn_backend", None)
            if backend is not None and layout.backend != "unknown" and backend.get_name() != layout.backend:
                raise LayoutError(f"layer {name} runs {backend.get_name()}, named for {layout.backend}")
            isa = getattr(layer, "isa", None)
            if isa is not None and layout.backend == "CPU_ATTN" and isa != layout.detail.split("/")[0]:
                raise LayoutError(f"layer {name} runs CPU ISA {isa}, named for {layout.layout_id}")
