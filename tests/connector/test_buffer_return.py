"""The buffer-return rule: a pinned buffer goes back to its pool only after the event of its last copy completed,
on every path, errors included (else the next user overwrites it while a copy still reads or writes it).

Errors are injected after a copy was queued; the recording StreamOps (tests/connector/fakes.py) keeps "the GPU"
paused, so a copy's event is incomplete until someone waits for it, and logs every pool release next to the waits.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from connector.device.pinned import HostBuffer, HostBufferPool
from connector.device.transfer import BlockTransfer, KVLayout
from tests.connector.fakes import FakeStream, RecordingStreams

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 2, 2, 16, 4, 16


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    return {f"l{i}": torch.randint(-(2**15), 2**15, shape, generator=g).to(torch.int16) for i in range(LAYERS)}


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingStreams]:
    s = RecordingStreams()
    s.set_current(FakeStream("forward"))
    release = HostBufferPool.release

    def logged(pool: HostBufferPool, buffer: HostBuffer) -> None:
        s.note("release")
        release(pool, buffer)

    monkeypatch.setattr(HostBufferPool, "release", logged)
    s.pause()
    try:
        yield s
    finally:
        s.resume()


def make(streams: RecordingStreams) -> BlockTransfer:
    return BlockTransfer(
        kv_caches=caches(1),
        layout=KVLayout.NHD,
        max_blocks_per_batch=2,
        store_buffers=1,
        load_buffers=1,
        streams=streams,
    )


def assert_released_after_a_fence(streams: RecordingStreams, stream: str, *, after: int) -> None:
    """The release follows a completed wait on an event recorded on ``stream`` after the copy was queued."""
    log = streams.since(after)
    releases = [i for i, op in enumerate(log) if op.kind == "release"]
    assert releases, "the buffer never went back to its pool"
    fences = {op.event for op in log[: releases[0]] if op.kind == "record" and op.stream == stream}
    waited = {op.event for op in log[: releases[0]] if op.kind == "host_wait"}
    assert fences & waited, (
        f"the buffer went back to the pool while its copy on {stream} may still run "
        f"(log before the release: {log[: releases[0]]})"
    )


def test_gather_error_after_the_copy_was_queued(streams: RecordingStreams) -> None:
    xfer = make(streams)
    streams.fail_records = 1  # the copy into the pinned buffer is queued; recording its event fails
    mark = streams.mark()
    with pytest.raises(RuntimeError, match="injected"):
        xfer.gather([3, 4])
    assert_released_after_a_fence(streams, xfer._store_stream.name, after=mark)
    assert xfer.store_pool.available == 1


def test_scatter_error_after_the_copy_was_queued(streams: RecordingStreams, monkeypatch: pytest.MonkeyPatch) -> None:
    xfer = make(streams)
    blob = bytes(xfer.geometry.block_bytes)
    real = torch.Tensor.index_copy_
    calls = 0

    def failing(self: torch.Tensor, dim: int, index: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 2:  # layer 1: the host->device copy of the buffer and layer 0's scatter are queued
            raise RuntimeError("injected: scatter failed")
        return real(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", failing)
    mark = streams.mark()
    with pytest.raises(RuntimeError, match="injected"):
        xfer.scatter([5, 6], [blob, blob])
    assert_released_after_a_fence(streams, xfer._load_stream.name, after=mark)
    assert xfer.load_pool.available == 1


def test_a_buffer_whose_copy_cannot_be_waited_for_never_returns(streams: RecordingStreams) -> None:
    """A sticky device error: nobody knows whether the copy still runs, so the buffer stays out of the pool."""
    xfer = make(streams)
    batch = xfer.gather([1])
    assert batch is not None
    event = streams.events[max(streams.events)]
    event.fail_sync = True
    with pytest.raises(RuntimeError, match="sticky"):
        batch.release()
    assert xfer.store_pool.available == 0
    assert not streams.ops("release")


def test_device_staging_is_owned_by_the_buffers_and_reported(streams: RecordingStreams) -> None:
    xfer = make(streams)
    capacity = xfer.store_pool.buffer_bytes
    assert xfer.staging_bytes == 2 * capacity  # one store and one load buffer, each with its staging
    assert all(b.staging is not None and b.staging.numel() == capacity for b in xfer.store_pool.buffers)
    streams.resume()
    batch = xfer.gather([1, 2])
    assert batch is not None
    batch.release()
    plain = BlockTransfer(
        kv_caches=caches(1), layout=KVLayout.NHD, max_blocks_per_batch=2, store_buffers=1, load_buffers=1
    )
    assert plain.staging_bytes == 0  # CPU tensors without streams: synchronous copies, no staging held
