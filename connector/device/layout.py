"""kvgate's canonical byte layout of one KV block, and which byte range of it a TP rank owns.

Pure arithmetic over the standard library: no torch here, so the gateway side and tests can use it freely.

One block object (format :data:`contract.keys.CANONICAL_FORMAT`) is, head-outermost and C-ordered::

    [kv_head][layer][k|v][token][head_dim]        elements of ``itemsize`` bytes, little-endian as in memory

``kv_head`` counts the model's *total* KV heads. Heads are the outermost axis, so the heads a TP rank holds
(``heads_of``) are one contiguous byte range of the object (``rank_byte_range``). A rank's local KV tensors hold
exactly its heads, so the canonical bytes of *all its local heads* (what ``connector.device.transfer`` gathers) are
that range, byte for byte, and the concatenation of the ranks' parts in rank order is the TP=1 object.

Runs that are not parallel-agnostic store each rank's whole local block in the same ordering, over its local
heads only: ``local_geometry(geometry, tp_size=...)`` describes that object.

``KVLayout`` names the dimension order of vLLM's paged per-layer KV tensors, and the permutations between them
and the canonical order that ``connector.device.transfer`` applies on the device.

``BackendLayout`` says how an attention backend really keeps K and V in vLLM's pages (``backend_layout`` derives it
from vLLM's declarations, never from tensor shapes), whether kvgate certifies it for the canonical format, and
``layer_views`` gives ``connector.device.transfer`` the views it copies from. This module never imports torch; the views
are built with the tensors' own methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from contract.keys import CANONICAL_FORMAT

if TYPE_CHECKING:
    import torch

__all__ = [
    "CANONICAL_FORMAT",
    "BackendLayout",
    "BlockGeometry",
    "KVLayout",
    "LayoutError",
    "PageFormat",
    "backend_layout",
    "head_byte_range",
    "heads_of",
    "layer_views",
    "local_geometry",
    "paged_geometry",
    "rank_byte_range",
]


@dataclass(frozen=True, slots=True)
class BlockGeometry:
    """Shape of one KV block of one KV-cache group, in the canonical layout."""

    num_layers: int
    num_kv_heads: int
    """Total KV heads of the object: the model's total for a canonical block, the local count for a rank's."""
    head_size: int
    block_size: int
    """Tokens per block."""
    itemsize: int
    """Bytes per element (2 for bf16/fp16, 1 for fp8)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "itemsize"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def bytes_per_head(self) -> int:
        """Bytes of one KV head across all layers, K and V, all tokens: one ``[kv_head]`` slab."""
        return self.num_layers * 2 * self.block_size * self.head_size * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_kv_heads * self.bytes_per_head

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The object's element shape ``(kv_head, layer, 2, token, head_dim)``."""
        return (self.num_kv_heads, self.num_layers, 2, self.block_size, self.head_size)


def heads_of(*, tp_size: int, rank: int, num_kv_heads: int) -> range:
    """The KV heads TP rank ``rank`` of ``tp_size`` holds when ``num_kv_heads`` heads are really sharded."""
    if tp_size <= 0:
        raise ValueError(f"tp_size must be positive, got {tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} out of range for tp_size {tp_size}")
    if num_kv_heads <= 0 or num_kv_heads % tp_size:
        raise ValueError(f"{num_kv_heads} KV heads cannot be sharded over tp_size {tp_size}")
    per_rank = num_kv_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def head_byte_range(geometry: BlockGeometry, *, heads: range) -> tuple[int, int]:
    """Half-open ``[start, end)`` byte range of a contiguous run of heads within the canonical object."""
    if heads.step != 1 or len(heads) == 0 or heads.start < 0 or heads.stop > geometry.num_kv_heads:
        raise ValueError(f"heads {heads!r} is not a non-empty contiguous range within {geometry.num_kv_heads}")
    return heads.start * geometry.bytes_per_head, heads.stop * geometry.bytes_per_head


def rank_byte_range(geometry: BlockGeometry, *, tp_size: int, rank: int) -> tuple[int, int]:
    """Half-open ``[start, end)`` byte range of the canonical object that TP rank ``rank`` writes and reads."""
    heads = heads_of(tp_size=tp_size, rank=rank, num_kv_heads=geometry.num_kv_heads)
    return head_byte_range(geometry, heads=heads)


def local_geometry(geometry: BlockGeometry, *, tp_size: int) -> BlockGeometry:
    """Geometry of one rank's local block (its own heads only), for runs that store per-rank objects."""
    local_heads = len(heads_of(tp_size=tp_size, rank=0, num_kv_heads=geometry.num_kv_heads))
    return BlockGeometry(
        num_layers=geometry.num_layers,
        num_kv_heads=local_heads,
        head_size=geometry.head_size,
        block_size=geometry.block_size,
        itemsize=geometry.itemsize,
    )


class KVLayout(StrEnum):
    """Logical dimension order of one layer's paged KV tensor (any strides; ``head_size`` must be contiguous).

    ``NHD``: ``(2, num_blocks, block_size, num_kv_heads, head_size)``, FlashAttention's default;
    ``HND``: ``(2, num_blocks, num_kv_heads, block_size, head_size)``.
    """

    NHD = "NHD"
    HND = "HND"

    @property
    def head_dim(self) -> int:
        return 3 if self is KVLayout.NHD else 2

    @property
    def token_dim(self) -> int:
        return 2 if self is KVLayout.NHD else 3

    @property
    def to_canonical(self) -> tuple[int, int, int, int, int]:
        """Permutes selected blocks ``(2, n, ...)`` of a layer to the canonical ``(n, head, 2, token, head_dim)``."""
        return (1, 3, 0, 2, 4) if self is KVLayout.NHD else (1, 2, 0, 3, 4)

    @property
    def from_canonical(self) -> tuple[int, int, int, int, int]:
        """The inverse of ``to_canonical``."""
        return (2, 0, 3, 1, 4) if self is KVLayout.NHD else (2, 0, 1, 3, 4)


def paged_geometry(*, shape: Sequence[int], layout: KVLayout, num_layers: int, itemsize: int) -> BlockGeometry:
    """Geometry of the block held by ``num_layers`` paged KV tensors of ``shape`` (local heads only)."""
    if len(shape) != 5 or shape[0] != 2:
        raise ValueError(f"expected a (2, num_blocks, ...) 5-d KV tensor shape, got {tuple(shape)}")
    return BlockGeometry(
        num_layers=num_layers,
        num_kv_heads=shape[layout.head_dim],
        head_size=shape[4],
        block_size=shape[layout.token_dim],
        itemsize=itemsize,
    )


# --- per-backend page layouts ---------------------------------------------------------------------------------
#
# vLLM (0.32 CPU build and 0.33) hands a connector one view per layer of LOGICAL shape [block, head, token, content]
# (``vllm.v1.kv_cache_interface.create_kv_cache_views``); the KV-cache layout setting (``KVCacheLayout``, e.g. LBNHC
# for NHD, LBHNC for HND) only changes the strides, and a backend may declare a different page (``num_head_slots``,
# ``state_content_bytes``) through its KV-cache spec. What the content axis holds is up to the backend's kernels:
#
# - FlashAttention, FlashInfer, Triton, FlexAttention (and the other dense-spec GPU backends) split content as
#   ``K = C[:head_size]``, ``V = C[head_size:]`` (``kv_cache.transpose(1, 2).split(head_size, dim=-1)`` in their
#   ``forward``): canonical after a permutation, in every stride order.
# - CPU_ATTN views each (block, head) page as ``(2 * block_size, head_size)`` and chunks it in two
#   (``kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1).chunk(2, dim=2)``): the first half is K, the
#   second V. Its kernels then write K column-major, ``[head_dim][token]``, and V row-major, ``[token][head_dim]``
#   (csrc/cpu/cpu_attn_vec.hpp, ISA "vec"); the AMX kernels (bf16 on AMX machines) pack both in tile order.
#
# A page kvgate has not certified against a reference (tests/engine, tests/vllm) is stored as it is, per rank,
# under a namespace whose fields carry the layout id, so it can never meet another layout's bytes.


class LayoutError(ValueError):
    """A KV tensor that does not match what vLLM declared for it: nothing is moved."""


class PageFormat(StrEnum):
    KV_CONTENT = "kv-content"
    """Dense page, ``K = C[:head_size]`` and ``V = C[head_size:]`` for each (block, head, token): certified."""
    CPU_KT = "cpu-kt"
    """CPU_ATTN "vec": per (block, head) a K page ``[head_dim][token]`` then a V page ``[token][head_dim]``."""
    RAW = "raw"
    """Not certified: the page's bytes in their own order (content cut in two halves), per rank and layout."""


CERTIFIED_GPU_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})
"""vLLM 0.33 GPU backends whose dense pages tests/vllm/test_backend_layouts.py builds as vLLM declares them."""
CERTIFIED_CPU_ISAS = frozenset({"vec"})
"""CPU_ATTN kernels whose pages tests/engine compared with HF transformers' K/V on a real engine."""


@dataclass(frozen=True, slots=True)
class BackendLayout:
    """How one KV-cache group's pages hold K and V, and under which id uncertified bytes are kept apart."""

    backend: str
    """vLLM's attention backend name (``get_name()``), e.g. ``FLASH_ATTN``, ``CPU_ATTN``."""
    page: PageFormat
    kv_cache_layout: str
    """vLLM's resolved ``KVCacheLayout`` name (stride order), e.g. ``LBNHC``."""
    detail: str = ""
    """What else picks the kernels' page order: the CPU ISA, the KV-cache dtype, why it is not certified."""

    @property
    def certified(self) -> bool:
        return self.page is not PageFormat.RAW

    @property
    def layout_id(self) -> str:
        """The id an uncertified layout puts in its namespace fields (``kv_layout``)."""
        parts = [self.backend, self.kv_cache_layout, self.detail]
        return "/".join(p for p in parts if p)


def backend_layout(
    *,
    backend: str,
    kv_cache_layout: str,
    head_size: int,
    head_size_v: int,
    kv_cache_dtype: str = "auto",
    dense_page: bool = True,
    cpu_isa: str | None = None,
) -> BackendLayout:
    """The page format of a backend, from vLLM's declarations: certified formats, else ``RAW`` with an id.

    ``dense_page`` is False when the backend's KV-cache spec declares its own page (``num_head_slots`` or
    ``state_content_bytes`` set, padded content, quantization scales inside the page).
    """
    quantized = kv_cache_dtype not in ("auto", "float32", "float16", "bfloat16")

    def raw(why: str) -> BackendLayout:
        detail = "/".join(x for x in (cpu_isa or "", kv_cache_dtype, why) if x)
        return BackendLayout(backend=backend, page=PageFormat.RAW, kv_cache_layout=kv_cache_layout, detail=detail)

    if head_size_v != head_size:
        return raw(f"k{head_size}v{head_size_v}")
    if quantized:
        return raw("quantized")
    if not dense_page:
        return raw("packed")
    if backend == "CPU_ATTN":
        if cpu_isa in CERTIFIED_CPU_ISAS:
            page = PageFormat.CPU_KT
            return BackendLayout(backend=backend, page=page, kv_cache_layout=kv_cache_layout, detail=cpu_isa)
        return raw("")
    if backend in CERTIFIED_GPU_BACKENDS:
        return BackendLayout(backend=backend, page=PageFormat.KV_CONTENT, kv_cache_layout=kv_cache_layout)
    return raw("")


def layer_views(
    kv: torch.Tensor, *, layout: BackendLayout, num_kv_heads: int, block_size: int, head_size: int
) -> tuple[list[torch.Tensor], KVLayout]:
    """The ``(2, blocks, heads, tokens, head_dim)`` views ``connector.device.transfer`` copies, for one layer's page
    tensor.

    ``kv`` is the logical ``[block, head, token, content]`` view vLLM registers. Heads, tokens and sizes come
    from vLLM's spec, not from the tensor's shape, so ``num_kv_heads == block_size`` is not ambiguous. A
    ``CPU_KT`` layer gives two views (K's and V's, each with its tokens cut in two halves): read in order they
    are the layer's ``[k|v][token][head_dim]``, so a transfer over all views writes the canonical bytes.
    """
    b = kv.shape[0] if kv.dim() == 4 else -1
    want = (b, num_kv_heads, block_size, 2 * head_size)
    if kv.dim() != 4 or tuple(kv.shape) != want:
        raise LayoutError(f"KV tensor shape {tuple(kv.shape)}, vLLM declared [block, head, token, content] {want}")
    if layout.page is PageFormat.KV_CONTENT or layout.page is PageFormat.RAW:
        view = kv.view(b, num_kv_heads, block_size, 2, head_size).permute(3, 0, 1, 2, 4)
        return [view], KVLayout.HND
    if kv.stride(3) != 1 or kv.stride(2) != 2 * head_size:
        raise LayoutError(f"CPU_ATTN page of strides {kv.stride()} is not contiguous per (block, head)")
    if block_size % 2:
        raise LayoutError(f"CPU_ATTN block size {block_size} is odd")
    half, page = block_size // 2, block_size * head_size
    sb, sh = kv.stride(0), kv.stride(1)
    offset = kv.storage_offset()
    k = kv.as_strided((2, b, num_kv_heads, half, head_size), (half, sb, sh, 1, block_size), offset)
    v = kv.as_strided((2, b, num_kv_heads, half, head_size), (half * head_size, sb, sh, head_size, 1), offset + page)
    return [k, v], KVLayout.HND
