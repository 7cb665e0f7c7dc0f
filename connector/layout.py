"""kvgate's canonical byte layout of one KV block, and which byte range of it a TP rank owns.

Pure arithmetic over the standard library: no torch here, so the gateway side and tests can use it freely.

One block object (format :data:`connector.protocol.CANONICAL_FORMAT`) is, head-outermost and C-ordered::

    [kv_head][layer][k|v][token][head_dim]        elements of ``itemsize`` bytes, little-endian as in memory

``kv_head`` counts the model's *total* KV heads. Heads are the outermost axis, so the heads a TP rank holds
(``heads_of``) are one contiguous byte range of the object (``rank_byte_range``). A rank's local KV tensors hold
exactly its heads, so the canonical bytes of *all its local heads* (what ``connector.transfer`` gathers) are
that range, byte for byte, and the concatenation of the ranks' parts in rank order is the TP=1 object.

Runs that are not parallel-agnostic store each rank's whole local block in the same ordering, over its local
heads only: ``local_geometry(geometry, tp_size=...)`` describes that object.

``KVLayout`` names the dimension order of vLLM's paged per-layer KV tensors, and the permutations between them
and the canonical order that ``connector.transfer`` applies on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from connector.protocol import CANONICAL_FORMAT

__all__ = [
    "CANONICAL_FORMAT",
    "BlockGeometry",
    "KVLayout",
    "content_range",
    "head_byte_range",
    "heads_of",
    "local_geometry",
    "paged_geometry",
    "range_header",
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


def _check_range(start: int, end: int) -> None:
    if not 0 <= start < end:
        raise ValueError(f"not a non-empty byte range: [{start}, {end})")


def content_range(*, start: int, end: int, total: int) -> str:
    """``Content-Range`` value for the half-open part ``[start, end)`` of a ``total``-byte object."""
    _check_range(start, end)
    if end > total:
        raise ValueError(f"range end {end} past object size {total}")
    return f"bytes {start}-{end - 1}/{total}"


def range_header(*, start: int, end: int) -> str:
    """``Range`` request value for the half-open byte range ``[start, end)``."""
    _check_range(start, end)
    return f"bytes={start}-{end - 1}"


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
