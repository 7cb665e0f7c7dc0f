"""The canonical layout's arithmetic, checked against numpy's own C-order offsets of the canonical array."""

from __future__ import annotations

import numpy as np
import pytest

from connector import layout, protocol
from connector.layout import (
    BlockGeometry,
    content_range,
    head_byte_range,
    heads_of,
    local_geometry,
    range_header,
    rank_byte_range,
)

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
    assert content_range(start=start, end=end, total=GEOM.block_bytes) == "bytes 65536-131071/262144"
    assert range_header(start=start, end=end) == "bytes=65536-131071"
    assert content_range(start=0, end=1, total=1) == "bytes 0-0/1"
    for bad in [(5, 5, 10), (-1, 3, 10), (0, 11, 10)]:
        with pytest.raises(ValueError):
            content_range(start=bad[0], end=bad[1], total=bad[2])
    with pytest.raises(ValueError):
        range_header(start=3, end=2)
