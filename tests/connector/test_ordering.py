"""The GPU ordering rules, checked on CPU through a recording StreamOps (tests/connector/fakes.py).

vLLM runs its forward pass on a dedicated non-default stream that it makes current on its main thread; the loads of
the connector are scattered from the client's event-loop thread, whose current stream is another one. The rules:

- a load's copies into the KV cache wait on an event the main thread recorded on its current stream (start_load_kv);
- a store's copies out of the KV cache are ordered after the forward pass that wrote the blocks (wait_for_save);
- handle_preemptions orders the forward stream after outstanding store copies on the GPU and waits on the host only
  for a preempted request that still has copies in flight;
- per-step work is bounded by what the step changed, not by all live state;
- event waits run on their own threads (not the default executor the client hashes on); the loop thread is bound
  to the device.

A real gateway on loopback serves the bytes; the copies run for real on CPU tensors and are compared byte for byte.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.plan import BlockJob
from connector.worker.pipeline import WorkerPipeline
from contract.keys import KVGroup, RunNaming, naming
from tests.connector.fakes import FakeStream, Op, RecordingStreams
from tests.gateway import Gateway

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS = 2, 2, 16, 4, 64
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
FORWARD = FakeStream("forward")


def kv(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE)
    return {n: torch.randint(-(2**15), 2**15, shape, generator=g).to(torch.int16).view(torch.bfloat16) for n in NAMES}


def run_naming() -> RunNaming:
    return naming(
        model_name="test-org/ordering",
        tokens_per_hash=BLOCK,
        tp_size=1,
        rank=0,
        dtype="bfloat16",
        groups=[KVGroup(tokens_per_block=BLOCK, layer_names=NAMES)],
        num_kv_heads=HEADS,
        total_kv_heads=HEADS,
    )


def make_pipeline(
    client: BlockClient, caches: dict[str, torch.Tensor], streams: RecordingStreams | None, *, per_batch: int = 2
) -> WorkerPipeline:
    xfer = BlockTransfer(
        kv_caches=caches,
        layout=KVLayout.NHD,
        max_blocks_per_batch=per_batch,
        store_buffers=64,
        load_buffers=2,
        streams=streams,
    )
    return WorkerPipeline(client=client, naming=run_naming(), transfers=[xfer], tp_size=1, tp_rank=0)


def hashes(tag: str, n: int) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(f"{tag}/{i}".encode()).digest() for i in range(n))


def job(req: str, hs: tuple[bytes, ...], ids: list[int]) -> BlockJob:
    return BlockJob(req_id=req, hashes=hs, block_ids=(tuple(ids),))


@pytest.fixture
def bc(gateway: Gateway) -> Iterator[BlockClient]:
    with BlockClient(ClientConfig(base_url=gateway.url, max_connections=8)) as c:
        yield c


@pytest.fixture
def streams() -> RecordingStreams:
    s = RecordingStreams()
    s.set_current(FORWARD)  # vLLM's main thread: its forward stream is current, not the default stream
    return s


def poll(done: Callable[[], bool], *, limit_s: float = 60.0) -> None:
    """Poll a condition (a safety limit, not a timing assertion)."""
    end = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def first(ops: list[Op]) -> Op:
    assert ops, "expected an operation that was not recorded"
    return ops[0]


def test_load_copies_wait_on_an_event_the_main_thread_recorded_on_the_forward_stream(
    bc: BlockClient, streams: RecordingStreams
) -> None:
    src = kv(1)
    writer = make_pipeline(bc, src, None)
    hs = hashes("load", 3)
    writer.start_stores([job("w", hs, [5, 6, 7])])
    writer.wait_uploads(60)
    assert writer.stats.stored_blocks == 3

    dest = kv(2)
    reader = make_pipeline(bc, dest, streams)
    xfer = reader.transfers[0]
    reader.start_loads([job("r", hs, [40, 41, 42])])  # on this (main) thread, as vLLM calls start_load_kv
    fut = reader._loads["r"][1]
    assert fut.result(timeout=60) == set()
    for name in NAMES:
        assert torch.equal(dest[name][:, 40:43].view(torch.int16), src[name][:, 5:8].view(torch.int16))

    load_stream = xfer._load_stream.name
    copies = streams.ops("use", stream=load_stream)
    assert copies, "the load ran no copies on its stream"
    assert all(op.thread != "MainThread" for op in copies)  # the scatter really runs on another thread
    for use in copies:
        before = [op for op in streams.ops("wait_event", stream=load_stream) if streams.index(op) < streams.index(use)]
        fenced = [
            op
            for op in before
            if op.event is not None
            and streams.events[op.event].recorded_by == "MainThread"
            and streams.events[op.event].stream == FORWARD.name
        ]
        assert fenced, (
            "a scatter into the KV cache was not ordered after the forward stream: the load stream never waited "
            f"on an event the main thread recorded on it (it waited on: {streams.ops('wait_stream')})"
        )


def test_store_copies_are_ordered_after_the_forward_stream(bc: BlockClient, streams: RecordingStreams) -> None:
    """Stores were already ordered on today's main (gather runs on the main thread); a guard, not a fix."""
    p = make_pipeline(bc, kv(3), streams)
    p.start_stores([job("s", hashes("store", 2), [1, 2])])
    p.wait_uploads(60)
    store_stream = p.transfers[0]._store_stream.name
    use = first(streams.ops("use", stream=store_stream))
    ordered = [
        op
        for op in streams.log[: streams.index(use)]
        if (op.kind == "wait_stream" and op.stream == store_stream and op.other == FORWARD.name)
        or (
            op.kind == "wait_event"
            and op.stream == store_stream
            and op.event is not None
            and streams.events[op.event].stream == FORWARD.name
        )
    ]
    assert ordered
    assert p.stats.stored_blocks == 2


def test_handle_preemptions_orders_the_forward_stream_without_a_host_wait(
    bc: BlockClient, streams: RecordingStreams
) -> None:
    p = make_pipeline(bc, kv(4), streams)
    store_stream = p.transfers[0]._store_stream.name
    streams.pause()  # the gathers stay on the GPU (behind a long forward pass)
    try:
        p.start_stores([job("a", hashes("a", 4), [1, 2, 3, 4]), job("b", hashes("b", 2), [9, 10])])
        store_events = {op.event for op in streams.ops("record", stream=store_stream)}
        mark = streams.mark()
        p.before_step(preempted=())  # handle_preemptions of the next step, nothing preempted
        step = streams.since(mark)
        host_waits = [op for op in step if op.kind == "host_wait" and op.thread == "MainThread"]
        assert not host_waits, f"handle_preemptions waited on the host for the GPU: {host_waits}"
        waited = {op.event for op in step if op.kind == "wait_event" and op.stream == FORWARD.name}
        last = max(store_events)  # one store stream: its last event covers every earlier copy on it
        assert last in waited, "the forward stream was not ordered after the outstanding store copies"
    finally:
        streams.resume()
    p.wait_uploads(60)
    assert p.stats.stored_blocks == 6


def test_preemption_waits_on_the_host_only_for_its_own_copies_in_flight(
    bc: BlockClient, streams: RecordingStreams
) -> None:
    p = make_pipeline(bc, kv(5), streams)
    store_stream = p.transfers[0]._store_stream.name
    streams.pause()
    try:
        mark = streams.mark()
        p.start_stores([job("a", hashes("pa", 2), [1, 2])])
        a_events = {op.event for op in streams.since(mark) if op.kind == "record" and op.stream == store_stream}
        mark = streams.mark()
        p.start_stores([job("b", hashes("pb", 2), [3, 4])])
        b_events = {op.event for op in streams.since(mark) if op.kind == "record" and op.stream == store_stream}
        mark = streams.mark()
        p.before_step(preempted=["a", "never-stored"])
        waited = {op.event for op in streams.since(mark) if op.kind == "host_wait" and op.thread == "MainThread"}
        assert waited & a_events, "a preempted request's blocks were freed while its copies were in flight"
        assert not waited & b_events, "handle_preemptions waited for copies of a request that was not preempted"
    finally:
        streams.resume()
    p.wait_uploads(60)
    mark = streams.mark()
    p.before_step(preempted=["b"])  # b's copies are done: nothing to wait for
    assert not [op for op in streams.since(mark) if op.kind == "host_wait"]


def test_per_step_work_does_not_grow_with_live_state(bc: BlockClient, streams: RecordingStreams) -> None:
    """A long-running request stores one batch per step; the per-step checks must not walk its whole history."""
    p = make_pipeline(bc, kv(6), streams, per_batch=1)
    live = [f"live{i}" for i in range(4)]
    cost: list[int] = []
    for step in range(12):
        p.start_stores([job(r, hashes(f"{r}/{step}", 1), [step + 4 * i]) for i, r in enumerate(live)])
        mark = streams.mark()
        p.before_step(preempted=())
        p.finished_stores(set())
        p.finished_loads()
        cost.append(len([op for op in streams.since(mark) if op.kind in ("query", "wait_event", "host_wait")]))
    p.wait_uploads(60)
    assert cost[-1] <= cost[1], f"per-step event work grows with the steps already taken: {cost}"

    mark = streams.mark()
    sending = p.finished_stores(set(live))
    assert sending == set(live)
    checks = len([op for op in streams.since(mark) if op.kind == "query"])
    assert checks <= len(live), f"finishing {len(live)} requests queried {checks} events (one per batch?)"
    assert not p.has_pending_frees


def test_event_waits_run_on_their_own_threads_and_the_loop_thread_is_bound(
    bc: BlockClient, streams: RecordingStreams
) -> None:
    p = make_pipeline(bc, kv(7), streams)
    binds = {op.thread for op in streams.ops("bind")}
    assert bc._thread.name in binds, f"the client's loop thread never set the device (bound: {binds})"
    streams.pause()
    try:
        p.start_stores([job("e", hashes("e", 2), [1, 2])])
        poll(lambda: bool(streams.ops("host_wait")))  # the upload is waiting for its copy
        waits = streams.ops("host_wait")
        assert all(op.thread.startswith("kvgate-event") for op in waits), [op.thread for op in waits]
        assert {op.thread for op in waits} <= {op.thread for op in streams.ops("bind")}
    finally:
        streams.resume()
    p.wait_uploads(60)
    assert p.stats.stored_blocks == 2
