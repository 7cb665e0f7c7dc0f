"""KVGateTier: kvgate as an out-of-tree secondary tier of vLLM 0.33's ``OffloadingConnector`` (TieringOffloadingSpec).

vLLM keeps its GPU <-> CPU machinery; this tier moves whole CPU chunk rows between the primary tier's memoryview
and a kvgate gateway, under the keys vLLM's own ``fs`` tier would use (``FileMapper`` with ``parallel_agnostic=True``,
paths relative to the root) and with the row bytes verbatim, so the gateway's filesystem backend is byte-compatible
with an ``fs`` tier directory. Configure it in ``kv_connector_extra_config.secondary_tiers``::

    {"type": "KVGateTier", "module_path": "connector.vllm_tier", "url": "http://127.0.0.1:8750"}

Every method runs on the scheduler's thread and returns at once: lookups are answered from verdicts of ONE batched
``POST /v1/lookup`` per scheduler step (a new key answers RETRY and joins the step's batch, sent from
``on_schedule_end``); transfers run on the background loop of ``connector.http.client.BlockClient`` within its budget
of bytes in flight. When the gateway is down or too slow the client opens its circuit for ``down_cooldown_s``:
lookups answer MISS and jobs fail at once. A full gateway (507) is not down: the store is dropped and counted
(``client.stats.full_stores``), lookups and loads go on. A load reads each row straight into its slot and verifies it
there (its checksum, its size): a row is reported loaded only when whole and intact, and vLLM reads no other slot; a
failed store is reported failed (vLLM drops it); a failed load reports the keys that did load.

This is the only module of kvgate, besides connector/vllm/connector.py, that imports vllm.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, OffloadingEvent, ReqContext
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    RequestOffloadingContext,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from connector.http.client import BlockClient, ConnectorError, GatewayUnavailable
from connector.vllm.settings import TierSettings
from connector.vllm.tier_meta import ChunkShape, RequestTokens, announced
from contract.keys import parse_block_key, parse_config_key

log = logging.getLogger("kvgate.vllm_tier")

_ROOT = "/kvgate-root"
"""FileMapper wants a root directory; the gateway's keys are the paths relative to it."""


@dataclass(slots=True)
class _Probe:
    """One key's lookup: None until the gateway answers; alive while a request refers to it."""

    result: bool | None = None
    reqs: set[str] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class _Done:
    job_id: int
    is_load: bool
    keys: list[bytes]
    ok: list[bool]
    seconds: float
    nbytes: int


class KVGateTier(SecondaryTierManager):  # type: ignore[misc]
    """A ``SecondaryTierManager`` whose medium is a kvgate gateway reached over HTTP."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        *,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        """``config``: the tier's keys of ``secondary_tiers`` (connector/vllm/settings.py: TierSettings), checked
        here."""
        self.settings = settings = TierSettings.parse(config)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(settings.locality) if settings.locality is not None else None
        self._rows = primary_kv_view.cast("B")
        self._row_bytes: int = int(self.block_size_bytes)
        self._transfer_timeout_s = settings.transfer_timeout_s
        self._load_deadline_s = settings.load_deadline_ms / 1000
        self.load_deadlines = 0
        """Load jobs that ran out of their deadline (the rows that had not arrived were reported not loaded)."""
        self._chunks = ChunkShape(  # a chunk's tokens and parent, for the gateway's KV events (tier_meta.py)
            tuple(t * offloading_spec.blocks_per_chunk for t in offloading_spec.tokens_per_block),
            offloading_spec.tokens_per_hash,
        )
        self._lookup_batch_keys = settings.lookup_batch_keys

        self.file_mapper = FileMapper.from_offloading_spec(
            root_dir=_ROOT,
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        self.namespace = parse_config_key(self._relative(self.file_mapper.get_config_file_path()))
        self._fields: dict[str, Any] = self.file_mapper.get_run_config()

        self.events: list[Any] | None = None
        if settings.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []

        # Scheduler-thread state (the tiering manager's lock serialises calls).
        self._probes: dict[bytes, _Probe] = {}
        self._req_keys: dict[str, set[bytes]] = {}
        self._unsent: list[tuple[bytes, _Probe]] = []
        self._lookups_in_flight = 0
        self._store_keys: dict[int, list[bytes]] = {}
        # Loop -> scheduler.
        self._answers: queue.SimpleQueue[list[tuple[_Probe, bool]]] = queue.SimpleQueue()
        self._finished: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        # Jobs submitted and not yet put on ``_finished`` (drain_jobs waits for zero).
        self._outstanding = 0
        self._idle = threading.Condition()

        # the client owns the byte budget and the circuit breaker, as it does for connector/vllm/connector.py
        self._client = BlockClient(settings.client_config())
        self._config_lock: asyncio.Lock = self._client.run(self._make_lock(), timeout_s=10.0)
        self._config_stored = False
        self._client.submit(self._ensure_config())  # the namespace's config.json, once, off this thread

    # -- naming --------------------------------------------------------------------------------------------------

    @staticmethod
    def _relative(path: str) -> str:
        return path.removeprefix(_ROOT + "/")

    def key_path(self, key: bytes) -> str:
        """The gateway key of an offload key: FileMapper's file name relative to the root."""
        path = self._relative(self.file_mapper.get_file_name(key))
        parse_block_key(path)  # raises InvalidKey on anything the gateway would refuse
        return path

    def _is_down(self) -> bool:
        return self._client.gateway_down

    # -- lookups (scheduler thread) ------------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> Any:
        if (tokens := announced.get()) is not None:  # KVGateOffloadingConnector tells the request's tokens
            req_context.set_state(tokens)
        return RequestOffloadingContext()

    def lookup(self, key: bytes, req_context: ReqContext) -> Any:
        self._apply_answers()
        probe = self._probes.get(key)
        if probe is None:
            if self._is_down():
                return LookupResult.MISS
            probe = _Probe()
            self._probes[key] = probe
            self._unsent.append((key, probe))
        probe.reqs.add(req_context.req_id)
        self._req_keys.setdefault(req_context.req_id, set()).add(key)
        if probe.result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if probe.result else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """Send this step's new keys as one batched lookup."""
        self._apply_answers()
        batch, self._unsent = self._unsent, []
        if not batch:
            return
        if self._is_down():
            for _key, probe in batch:
                probe.result = False
            return
        self._lookups_in_flight += 1
        try:
            self._client.submit(self._lookup(batch))
        except RuntimeError:  # the loop is closed: shutting down
            self._lookups_in_flight -= 1
            for _key, probe in batch:
                probe.result = False

    def _apply_answers(self) -> None:
        while True:
            try:
                answers = self._answers.get_nowait()
            except queue.Empty:
                return
            self._lookups_in_flight -= 1
            for probe, found in answers:
                probe.result = found

    def on_request_finished(self, req_context: ReqContext) -> None:
        req_id = req_context.req_id
        for key in self._req_keys.pop(req_id, ()):
            probe = self._probes.get(key)
            if probe is None:
                continue
            probe.reqs.discard(req_id)
            if not probe.reqs:
                del self._probes[key]

    def has_pending_work(self) -> bool:
        return bool(self._unsent) or self._lookups_in_flight > 0

    # -- jobs (scheduler thread) ---------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        if self.events is not None:
            self._store_keys[job_metadata.job_id] = keys
        # Keys this tier already knows are on the gateway are not sent again.
        present = [(p := self._probes.get(k)) is not None and p.result is True for k in keys]
        ctx, tokens = job_metadata.req_context, job_metadata.req_context.get_state(RequestTokens)
        metas = [self._chunks.meta(tokens, key=k, end=ctx.get_offload_key_position(k)) for k in job_metadata.keys]
        coro = self._store(job_metadata.job_id, keys, chunk_ids, present, metas)
        self._start(coro, job_metadata.job_id, keys, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = [bytes(k) for k in job_metadata.keys]
        chunk_ids = [int(c) for c in job_metadata.chunk_ids]
        self._start(self._load(job_metadata.job_id, keys, chunk_ids), job_metadata.job_id, keys, is_load=True)

    def _start(self, coro: Any, job_id: int, keys: list[bytes], *, is_load: bool) -> None:
        with self._idle:
            self._outstanding += 1
        if self._is_down():
            coro.close()
            self._report(_Done(job_id, is_load, keys, [False] * len(keys), 0.0, 0))
            return
        try:
            self._client.submit(coro)
        except RuntimeError:
            coro.close()
            self._report(_Done(job_id, is_load, keys, [False] * len(keys), 0.0, 0))

    def _report(self, done: _Done) -> None:
        self._finished.put(done)
        with self._idle:
            self._outstanding -= 1
            self._idle.notify_all()

    def get_finished_jobs(self) -> Iterable[Any]:
        results = []
        while True:
            try:
                done = self._finished.get_nowait()
            except queue.Empty:
                break
            results.append(self._result(done))
        return results

    def _result(self, done: _Done) -> Any:
        success = all(done.ok)
        store_keys = self._store_keys.pop(done.job_id, None)
        for key, ok in zip(done.keys, done.ok, strict=True):
            probe = self._probes.get(key)
            if probe is None or probe.result is None:
                continue
            if done.is_load and not ok:
                probe.result = False  # lost or mangled on the gateway: stop promoting it (vLLM would loop)
            elif not done.is_load and ok:
                probe.result = True
        if self.events is not None and store_keys and success:
            self.events.append(
                OffloadingEvent(keys=store_keys, medium=self.medium, removed=False, locality=self.locality)
            )
        successful = None
        if done.is_load and not success:
            loaded = tuple(k for k, ok in zip(done.keys, done.ok, strict=True) if ok)
            successful = loaded or None
        return JobResult(
            job_id=done.job_id,
            success=success,
            successful_keys=successful,
            transfer_time=done.seconds,
            transfer_bytes=done.nbytes or None,
        )

    def take_events(self) -> Iterable[Any]:
        if self.events:
            events, self.events = self.events, []
            yield from events

    def drain_jobs(self) -> None:
        """Wait until every submitted job has reported (each transfer is bounded by its timeouts)."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)

    def shutdown(self) -> None:
        self.drain_jobs()
        self._client.close()
        self._rows.release()

    # -- the background loop -------------------------------------------------------------------------------------

    @staticmethod
    async def _make_lock() -> asyncio.Lock:
        return asyncio.Lock()

    async def _ensure_config(self) -> bool:
        """PUT the namespace's fields once; the gateway writes ``<ns>/config.json`` as vLLM's fs tier does."""
        if self._config_stored:
            return True
        async with self._config_lock:
            if self._config_stored:
                return True
            try:
                await self._client.put_config(self.namespace, self._fields)
            except GatewayUnavailable:  # the client opened its circuit
                return False
            except ConnectorError as exc:
                log.error("kvgate tier: namespace %s config refused: %s", self.namespace, exc)
                return False
            self._config_stored = True
            return True

    async def _lookup(self, batch: list[tuple[bytes, _Probe]]) -> None:
        answers: list[tuple[_Probe, bool]] = []
        try:
            for start in range(0, len(batch), self._lookup_batch_keys):
                part = batch[start : start + self._lookup_batch_keys]
                if self._is_down():
                    answers.extend((probe, False) for _key, probe in part)
                    continue
                try:
                    paths = [self.key_path(k) for k, _p in part]
                    _prefix, slots = await self._client.lookup(paths)
                    answers.extend((probe, slot.present) for (_k, probe), slot in zip(part, slots, strict=True))
                except GatewayUnavailable:  # the client opened its circuit
                    answers.extend((probe, False) for _key, probe in part)
                except Exception as exc:  # a refused batch is a miss for its keys, never a stuck RETRY
                    log.error("kvgate tier: lookup of %d keys failed: %s", len(part), exc)
                    answers.extend((probe, False) for _key, probe in part)
        finally:
            self._answers.put(answers)

    async def _store(
        self, job_id: int, keys: list[bytes], chunk_ids: list[int], present: list[bool], metas: list[str | None]
    ) -> None:
        started = time.monotonic()
        ok = [False] * len(keys)
        sent_bytes = 0
        try:
            if await self._ensure_config():
                rows = list(zip(keys, chunk_ids, present, metas, strict=True))
                sent = await asyncio.gather(*(self._store_row(k, c, m) for k, c, known, m in rows if not known))
                sent_bytes = sum(sent) * self._row_bytes
                results = iter(sent)
                ok = [True if known else next(results) for known in present]
        finally:
            self._report(_Done(job_id, False, keys, ok, time.monotonic() - started, sent_bytes))

    async def _store_row(self, key: bytes, chunk_id: int, meta: str | None) -> bool:
        if self._is_down():
            return False
        offset = chunk_id * self._row_bytes
        try:
            async with self._client.hold(self._row_bytes, timeout_s=self._transfer_timeout_s):
                body = self._rows[offset : offset + self._row_bytes]
                # False: the gateway is full (507)
                return await self._client.put(self.key_path(key), body, meta=meta)
        except GatewayUnavailable:  # the client opened its circuit
            pass
        except Exception as exc:
            log.warning("kvgate tier: store of chunk %d failed: %r", chunk_id, exc)
        return False

    async def _load(self, job_id: int, keys: list[bytes], chunk_ids: list[int]) -> None:
        """Load the rows at once; past the deadline the GETs still in flight are cancelled and only the rows that
        arrived whole are reported loaded (vLLM recomputes the others)."""
        started = time.monotonic()
        ok = [False] * len(keys)
        rows = [asyncio.ensure_future(self._load_row(k, c)) for k, c in zip(keys, chunk_ids, strict=True)]
        try:
            if rows:
                await asyncio.wait(rows, timeout=self._load_deadline_s)
        finally:
            for row in rows:
                row.cancel()
            if rows:
                await asyncio.wait(rows)  # every GET has stopped writing into its slot before the job reports
            ok = [r.done() and not r.cancelled() and r.exception() is None and r.result() is True for r in rows]
            if not all(ok) and time.monotonic() - started >= self._load_deadline_s:
                self.load_deadlines += 1
                log.warning("kvgate tier: load job %d past its deadline: %d of %d rows", job_id, sum(ok), len(ok))
            self._report(_Done(job_id, True, keys, ok, time.monotonic() - started, sum(ok) * self._row_bytes))

    async def _load_row(self, key: bytes, chunk_id: int) -> bool:
        if self._is_down():
            return False
        offset = chunk_id * self._row_bytes
        try:
            async with self._client.hold(self._row_bytes, timeout_s=self._transfer_timeout_s):
                # Read straight into the row's slot and verified there against the version's checksum; False if missing,
                # of another size or corrupt. The slot is vLLM's only once the job reports the key loaded.
                row = self._rows[offset : offset + self._row_bytes]
                return await self._client.get_into(self.key_path(key), row)
        except GatewayUnavailable:  # the client opened its circuit
            pass
        except Exception as exc:
            log.warning("kvgate tier: load into chunk %d failed: %r", chunk_id, exc)
        return False
