"""The worker side of the connector, free of vLLM: gather -> fence -> PUT, and GET -> scatter, per request.

Stores: ``BlockTransfer.gather`` copies a batch of blocks into a pinned buffer (no CPU wait); the batch and its
upload then run on the client's loop: wait for the copy event, PUT each block (the client hashes it), release the
buffer. A batch that finds no free buffer or no room in the client's in-flight budget is dropped and counted;
a P/D producer's batch (``BlockJob.keep``: the only copy its consumer will have) first waits, bounded by
``keep_wait_s``, for an upload in flight to give room back (``keep_waits``), and is counted apart if dropped.

Loads: for each window of blocks, GET each block's bytes (a TP rank's range of the canonical object when the run
is parallel-agnostic), then scatter the window into the KV tensors and wait for its event. The first block that
misses, fails or is corrupt ends the load: it and every later block of the request are reported as load errors.

Ordering (the hooks below run on vLLM's main thread, whose current stream is its forward stream):
- ``start_loads`` records an event there; every scatter of those loads, issued later from the client's loop
  thread, waits on it before copying into the KV cache. ``start_stores`` does the same for its gathers.
- ``before_step`` (handle_preemptions) makes the forward stream wait on the newest store copy of each group (one
  store stream per group, so it covers all earlier ones) and waits on the host only for a preempted request whose
  copies are still in flight. Each request keeps only its newest event per group, so the per-step checks cost
  O(groups) per request they look at, never O(batches stored so far).

Parallel-agnostic runs name blocks once (rank 0) and store the canonical object: rank ``r`` of ``tp`` PUTs its
byte range as a part (``Content-Range``), and a reader at any TP size GETs the range of its own heads. Other runs
store each rank's whole local block under its rank's path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from connector.device.layout import BlockGeometry, rank_byte_range
from connector.device.streams import CopyEvent, StreamOps
from connector.device.transfer import BlockTransfer, StagedBatch
from connector.http.client import BlockClient
from connector.planning.cost import LoadOutcome
from connector.planning.plan import BlockJob
from connector.worker.loader import BlockLoader
from connector.worker.prefetch import Prefetcher
from contract.keys import RunNaming

log = logging.getLogger("kvgate.connector.pipeline")


@dataclass(slots=True)
class PipelineStats:
    stored_blocks: int = 0
    dropped_blocks: int = 0
    failed_blocks: int = 0
    loaded_blocks: int = 0
    load_errors: int = 0
    load_waits: int = 0
    """Idle steps that waited for a load in flight (``finished_loads`` with ``wait_s``) instead of returning."""
    expired_loads: int = 0
    """Loads that ran out of their deadline (the blocks that had not arrived were reported)."""
    keep_waits: int = 0
    """Times a P/D producer's store waited for buffer room (its step was held) instead of being dropped."""
    dropped_kept_blocks: int = 0
    """P/D producer blocks dropped all the same: no room came back within ``keep_wait_s`` (also in
    ``dropped_blocks``); their consumer recomputes them."""
    dropped_budget_blocks: int = 0
    """Blocks dropped because the client's budget of bytes in flight was full (also in ``dropped_blocks``)."""
    dropped_buffer_blocks: int = 0
    """Blocks dropped because no store buffer was free (also in ``dropped_blocks``)."""
    dropped_full_blocks: int = 0
    """Blocks the gateway refused as full (507; also in ``dropped_blocks``)."""
    dropped_requests: int = 0
    """Store jobs (one request's new blocks of one step) that lost a block for want of room (budget or buffer)."""


WORKER_COUNTERS: dict[str, str] = {
    "stored_blocks": "stored_blocks",
    "stored_bytes": "client.put_bytes",
    "loaded_blocks": "loaded_blocks",
    "loaded_bytes": "client.get_bytes",
    "store_drops_budget": "dropped_budget_blocks",
    "store_drops_buffer": "dropped_buffer_blocks",
    "store_drops_full": "dropped_full_blocks",
    "store_drops_failed": "failed_blocks",
    "dropped_store_requests": "dropped_requests",
    "dropped_handoff_blocks": "dropped_kept_blocks",
    "handoff_store_waits": "keep_waits",
    "expired_loads": "expired_loads",
    "load_failed_blocks": "load_errors",
    "corrupt_reads": "client.corrupt_reads",
    "prefetch_started": "prefetch.started",
    "prefetch_blocks": "prefetch.blocks",
    "prefetch_used": "prefetch.used",
    "prefetch_dropped": "prefetch.dropped",
    "prefetch_hits": "prefetch.hits",
    "prefetch_overflows": "prefetch.overflows",
}
"""``WorkerPipeline.report`` key -> the count it reports the increments of: a ``PipelineStats`` field, or
``client.<field>`` of the client's ``ClientStats``, or ``prefetch.<field>`` of the ``PrefetchStats``
(connector/worker/prefetch.py). The keys are not the scheduler's (``PlanStats.COUNTERS``)."""

WORKER_GAUGES = ("store_bytes_held", "load_bytes_held", "prefetch_bytes_held")
"""``WorkerPipeline.report`` keys of the host bytes in use now: store buffers holding gathered blocks until their
upload ends, load buffers holding read blocks until their scatter ends, prefetch buffers holding blocks fetched at
a request's arrival until its load or its drop (pinned on a GPU)."""


@dataclass(slots=True)
class _Pending:
    last: dict[int, CopyEvent] = field(default_factory=dict)
    """Group -> the event of the request's newest gather (copies on a group's store stream finish in order)."""


class WorkerPipeline:
    """One worker rank's stores and loads. ``transfers[g]`` moves the blocks of KV-cache group ``g``."""

    def __init__(
        self,
        *,
        client: BlockClient,
        naming: RunNaming,
        transfers: Sequence[BlockTransfer],
        tp_size: int,
        tp_rank: int,
        keep_wait_s: float = 5.0,
        prefetch_budget_bytes: int = 0,
    ) -> None:
        """``keep_wait_s``: the longest a P/D producer's store (``BlockJob.keep``) waits for buffer room;
        ``prefetch_budget_bytes``: the most host bytes held for blocks fetched at arrival (0: no prefetch)."""
        self.client = client
        self.keep_wait_s = keep_wait_s
        self.naming = naming
        self.transfers = list(transfers)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.stats = PipelineStats()
        self._lock = threading.Lock()
        self._load_done = threading.Condition(self._lock)
        """Notified (under ``_lock``) when a load completes: an idle step's ``finished_loads`` waits on it."""
        self._stores: dict[str, _Pending] = {}
        self._loads: dict[str, tuple[BlockJob, concurrent.futures.Future[set[int]]]] = {}
        self._ever_stored: set[str] = set()
        self._pending_free: set[str] = set()
        self._uploads: set[concurrent.futures.Future[int]] = set()
        self._unordered: dict[int, CopyEvent] = {}
        """Group -> newest store copy the forward stream has not been ordered after yet."""
        self._newest: dict[int, CopyEvent] = {}
        self._done_loads: deque[str] = deque()
        self._outcomes: dict[str, LoadOutcome] = {}
        self._reported: dict[str, int] = {}
        self._held: dict[str, int] = {}
        ranges = [None if (r := self.part_range(t)) is None else r[:2] for t in self.transfers]
        self.prefetch = Prefetcher(
            client=client,
            naming=naming,
            transfers=self.transfers,
            ranges=ranges,
            budget_bytes=prefetch_budget_bytes,
            pin=any(t.device.type == "cuda" for t in self.transfers),
        )
        self._loader = BlockLoader(
            client=client, naming=naming, transfers=self.transfers, ranges=ranges, prefetch=self.prefetch
        )
        for streams in {id(t.streams): t.streams for t in self.transfers if t.streams is not None}.values():
            client.run(_bind(streams), timeout_s=30.0)  # the loop thread's CUDA calls go to the KV's device

    # -- the engine's hooks, called on vLLM's main thread ------------------------------------------------------

    def start_loads(self, jobs: Sequence[BlockJob]) -> None:
        """``start_load_kv``: start the step's loads, ordered after everything queued on this thread's stream."""
        if not jobs:
            return
        after = [t.mark() for t in self.transfers]
        for job in jobs:
            self.load(job, after=after)

    def start_prefetches(self, jobs: Sequence[BlockJob], *, drops: Collection[str] = ()) -> None:
        """``start_load_kv``, before the step's loads: start fetching the blocks of requests not admitted yet into
        host memory (connector/worker/prefetch.py), and free those of ``drops`` (finished, aborted, not loaded)."""
        for job in jobs:
            self.client.submit(self._prefetch_start(job))
        for req_id in drops:
            self.client.submit(self.prefetch.release(req_id))

    async def _prefetch_start(self, job: BlockJob) -> None:
        self.prefetch.start(job)

    def start_stores(self, jobs: Sequence[BlockJob]) -> None:
        """``wait_for_save``: start the step's stores, ordered after the forward pass that wrote their blocks."""
        if not jobs:
            return
        after = [t.mark() for t in self.transfers]
        for job in jobs:
            self._ever_stored.add(job.req_id)
            self.store(job, after=after)

    def before_step(self, *, preempted: Collection[str] = ()) -> None:
        """``handle_preemptions``: before the next forward pass may overwrite freed blocks.

        The forward stream waits (on the device) for the store copies queued since the last call; the host waits
        only for a preempted request whose copies are still in flight (its blocks go back to vLLM's free pool).
        """
        with self._lock:
            unordered, self._unordered = self._unordered, {}
            last = [e for r in preempted if (p := self._stores.get(r)) is not None for e in p.last.values()]
        for group, event in unordered.items():
            self.transfers[group].order_current_stream_after(event)
        for event in last:
            if not event.query():
                event.synchronize()

    def finished_stores(self, finished_req_ids: Collection[str]) -> set[str]:
        """``get_finished``: finished requests whose blocks no store copy reads any more (vLLM may free them)."""
        self._pending_free.update(r for r in finished_req_ids if r in self._ever_stored)
        sending = {r for r in self._pending_free if self.copies_done(r)}
        for r in sending:
            self._pending_free.discard(r)
            self._ever_stored.discard(r)
            self.forget(r)
        return sending

    @property
    def has_pending_frees(self) -> bool:
        return bool(self._pending_free)

    # -- naming and byte ranges ------------------------------------------------------------------------------

    def _canonical(self, transfer: BlockTransfer) -> BlockGeometry:
        g = transfer.geometry
        if not self.naming.parallel_agnostic:
            return g
        return BlockGeometry(
            num_layers=g.num_layers,
            num_kv_heads=g.num_kv_heads * self.tp_size,
            head_size=g.head_size,
            block_size=g.block_size,
            itemsize=g.itemsize,
        )

    def part_range(self, transfer: BlockTransfer) -> tuple[int, int, int] | None:
        """``(start, end, total)`` of this rank's part of a block object; None when it writes the whole object."""
        if not self.naming.parallel_agnostic or self.tp_size == 1:
            return None
        canonical = self._canonical(transfer)
        start, end = rank_byte_range(canonical, tp_size=self.tp_size, rank=self.tp_rank)
        return start, end, canonical.block_bytes

    # -- what the worker reports -----------------------------------------------------------------------------

    def held_bytes(self) -> dict[str, int]:
        """``WORKER_GAUGES``: the host bytes of the store and load buffers in use now, over every KV group."""
        store = sum((t.store_pool.size - t.store_pool.available) * t.store_pool.buffer_bytes for t in self.transfers)
        load = sum((t.load_pool.size - t.load_pool.available) * t.load_pool.buffer_bytes for t in self.transfers)
        return {"store_bytes_held": store, "load_bytes_held": load, "prefetch_bytes_held": self.prefetch.held_bytes}

    def _count(self, field: str) -> int:
        if field.startswith("client."):
            return int(getattr(self.client.stats, field.removeprefix("client.")))
        if field.startswith("prefetch."):
            return int(getattr(self.prefetch.stats, field.removeprefix("prefetch.")))
        return int(getattr(self.stats, field))

    def report(self) -> dict[str, int]:
        """What this rank counted since the last report (``WORKER_COUNTERS``, only those that changed), and the
        host bytes held now (``WORKER_GAUGES``: each when not 0 or changed since the last report, so the report
        that follows the last transfer says 0); empty when nothing happened and nothing is held."""
        now = {key: self._count(field) for key, field in WORKER_COUNTERS.items()}
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        self._reported = now
        held = self.held_bytes()
        delta.update({k: v for k, v in held.items() if v or v != self._held.get(k, 0)})
        self._held = held
        return delta

    # -- stores --------------------------------------------------------------------------------------------

    def store(self, job: BlockJob, *, after: Sequence[CopyEvent] | None = None) -> None:
        """Start storing ``job``'s blocks; never waits on the network or the copy.

        ``after[g]``: the event (``mark()``) of the forward pass that wrote group ``g``'s blocks."""
        pending = self._pending(job.req_id)
        dropped = False
        for group, transfer in enumerate(self.transfers):
            ids = job.block_ids[group]
            part = self.part_range(transfer)
            for start in range(0, len(ids), transfer.max_blocks_per_batch):
                chunk = ids[start : start + transfer.max_blocks_per_batch]
                keys = [self.naming.block(h, group) for h in job.hashes[start : start + len(chunk)]]
                metas: list[str | None] = list(job.metas[start : start + len(chunk)] or (None,) * len(chunk))
                nbytes = len(chunk) * transfer.geometry.block_bytes
                batch = self._stage(
                    transfer, chunk, nbytes, after=None if after is None else after[group], keep=job.keep
                )
                if batch is None:
                    dropped = True
                    self.stats.dropped_blocks += len(chunk)
                    if job.keep:
                        self.stats.dropped_kept_blocks += len(chunk)
                        log.warning(
                            "P/D store of req=%s dropped: no buffer room in %.1fs", job.req_id, self.keep_wait_s
                        )
                    continue
                with self._lock:
                    pending.last[group] = self._unordered[group] = self._newest[group] = batch.event
                    upload = self.client.submit(self._upload(batch, keys, metas, part, nbytes))
                    self._uploads.add(upload)
                upload.add_done_callback(self._upload_done)
        if dropped:
            self.stats.dropped_requests += 1

    def _stage(
        self, transfer: BlockTransfer, chunk: Sequence[int], nbytes: int, *, after: CopyEvent | None, keep: bool
    ) -> StagedBatch | None:
        """Budget and a buffer for ``chunk``, and its gather started; None when there is no room. A ``keep`` batch
        waits (up to ``keep_wait_s``) for an upload in flight to finish and give its room back, then tries again."""
        deadline = time.monotonic() + (self.keep_wait_s if keep else 0.0)
        while True:
            with self._lock:
                uploads = list(self._uploads)
            left = deadline - time.monotonic()
            last = left <= 0 or not uploads  # nothing in flight would give room back: the client counts a drop
            fits = self.client.reserve(nbytes, count=last)
            if fits:
                try:
                    batch = transfer.gather(chunk, after=after)
                except BaseException:
                    self.client.release(nbytes)
                    raise
                if batch is not None:
                    return batch
                self.client.release(nbytes)
            if last:
                if not fits:
                    self.stats.dropped_budget_blocks += len(chunk)
                else:
                    self.stats.dropped_buffer_blocks += len(chunk)
                return None
            self.stats.keep_waits += 1
            concurrent.futures.wait(uploads, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)

    async def _upload(
        self,
        batch: StagedBatch,
        keys: list[str],
        metas: list[str | None],
        part: tuple[int, int, int] | None,
        nbytes: int,
    ) -> int:
        try:
            await batch.wait()
            results = await asyncio.gather(  # started in chain order: a block's parent before it (its events wait)
                *(
                    self.client.put(key, batch.block_view(i), content_range=part, meta=meta)
                    for i, (key, meta) in enumerate(zip(keys, metas, strict=True))
                ),
                return_exceptions=True,
            )
        finally:
            batch.release()
            self.client.release(nbytes)
        ok = 0
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):  # counted by the client too (``stats.failed_stores``)
                self.stats.failed_blocks += 1
                log.warning("store failed key=%s: %s", key, result)
            elif result:
                ok += 1
            else:  # the gateway is full (507): dropped and counted by the client, not an outage
                self.stats.dropped_blocks += 1
                self.stats.dropped_full_blocks += 1
        self.stats.stored_blocks += ok
        return ok

    def _upload_done(self, fut: concurrent.futures.Future[int]) -> None:
        with self._lock:
            self._uploads.discard(fut)

    def _pending(self, req_id: str) -> _Pending:
        with self._lock:
            return self._stores.setdefault(req_id, _Pending())

    def copies_done(self, req_id: str) -> bool:
        """True once every gather of ``req_id`` has left the KV tensors (its blocks may then be reused)."""
        pending = self._stores.get(req_id)
        return pending is None or all(event.query() for event in pending.last.values())

    def forget(self, req_id: str) -> None:
        with self._lock:
            self._stores.pop(req_id, None)

    def sync_copies(self) -> None:
        """Wait on the host for every gather started so far (shutdown, tests)."""
        with self._lock:
            newest = list(self._newest.values())
        for event in newest:
            event.synchronize()

    def wait_uploads(self, timeout_s: float | None = None) -> None:
        """Wait until every upload started so far has finished (tests, benchmarks and shutdown)."""
        with self._lock:
            futs = list(self._uploads)
        concurrent.futures.wait(futs, timeout=timeout_s)

    def close(self) -> None:
        if self.prefetch.held_bytes:
            self.client.run(self.prefetch.close(), timeout_s=30.0)
        for transfer in self.transfers:
            transfer.close()

    # -- loads ---------------------------------------------------------------------------------------------

    def load(self, job: BlockJob, *, after: Sequence[CopyEvent] | None = None) -> concurrent.futures.Future[set[int]]:
        """Start loading ``job``; the future gives the block ids that could not be loaded (empty: all loaded).

        ``after[g]``: the event (``mark()``) its scatters into group ``g`` wait on; see ``start_loads``."""
        fut = self.client.submit(self._load(job, after))
        with self._lock:
            self._loads[job.req_id] = (job, fut)
        fut.add_done_callback(lambda _: self._loaded(job.req_id))
        return fut

    def _loaded(self, req_id: str) -> None:
        with self._load_done:
            self._done_loads.append(req_id)
            self._load_done.notify_all()

    async def _load(self, job: BlockJob, after: Sequence[CopyEvent] | None) -> set[int]:
        n = len(job.hashes)
        if self.prefetch.ready(job):  # every block in host memory when the scheduler admitted the request
            self.prefetch.stats.hits += 1
        try:
            outcome = await self._loader.load(job, after)
        finally:
            await self.prefetch.release(job.req_id)
        loaded = outcome.loaded
        failed = {bid for group in job.block_ids for bid in group[loaded:]}
        self.stats.loaded_blocks += loaded
        if failed:
            self.stats.load_errors += n - loaded
        if outcome.expired:
            self.stats.expired_loads += 1
        with self._lock:
            self._outcomes[job.req_id] = outcome
        return failed

    def take_outcomes(self) -> dict[str, LoadOutcome]:
        """What the loads that ended since the last call measured, by request (for the scheduler's cost model)."""
        with self._lock:
            outcomes, self._outcomes = self._outcomes, {}
        return outcomes

    def finished_loads(self, *, wait_s: float = 0.0) -> dict[str, set[int]]:
        """Loads that completed since the last call: request id -> block ids that failed to load.

        ``wait_s`` > 0 (an engine step with nothing scheduled): when none has completed yet and some are in flight,
        wait up to ``wait_s`` for the first to complete, with the GIL released, instead of returning at once: an
        engine that steps again at once spins, and holds the GIL and a core that the loads need."""
        done: dict[str, set[int]] = {}
        with self._load_done:
            if wait_s > 0 and not self._done_loads and self._loads:
                self.stats.load_waits += 1
                self._load_done.wait_for(lambda: bool(self._done_loads), timeout=wait_s)
            while self._done_loads:  # only the loads that completed: never a walk over every live load
                req_id = self._done_loads.popleft()
                if (entry := self._loads.get(req_id)) is None or not entry[1].done():
                    continue
                job, fut = self._loads.pop(req_id)
                try:
                    done[req_id] = fut.result()
                except BaseException as exc:  # a bug: report every block as failed, never a silent load
                    log.error("load crashed req=%s: %r", req_id, exc)
                    done[req_id] = {bid for group in job.block_ids for bid in group}
        return done


async def _bind(streams: StreamOps) -> None:
    streams.bind_thread()
