"""What to load and store for each request: the scheduler-side core of the connector, free of vLLM.

connector/vllm/connector.py feeds it plain values (request ids, block hashes, block ids per KV-cache group, token
counts) and ships the ``StepPlan`` it builds to the workers. One ``POST /v1/lookup`` per request finds the hit (a lookup
unanswered after ``lookup_deadline_s`` is a miss); the cost model decides how much of it to load, and the load's
deadline (connector/planning/cost.py); the lookup runs on the client's loop and is picked up by a later call
(``None``: "ask again"). A step that has work never waits on the network; a step with nothing scheduled
(``build(idle=True)``) first waits up to ``lookup_wait_s`` for a lookup in flight, and tells the workers, which wait for
their loads in flight (connector/worker/pipeline.py): an engine that stepped again at once would spin, holding the GIL
and a core that the lookups and loads need.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from connector.http.client import BlockClient, ConnectorError, LookupSlot
from connector.planning.cost import MIB, CostModel, Decision, LoadOutcome, Verdict
from connector.planning.handoff import Expected
from contract.keys import RunNaming, block_path
from contract.wire import format_block_meta

log = logging.getLogger("kvgate.connector.plan")


@dataclass(frozen=True, slots=True)
class BlockJob:
    """Blocks of one request to move, per KV-cache group: ``block_ids[g][i]`` holds the block of ``hashes[i]``."""

    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[tuple[int, ...], ...]
    metas: tuple[str | None, ...] = ()
    """Stores: each block's ``X-KVGate-Block-Meta`` (its token ids and its parent's hash, from vLLM's request),
    so that the gateway's KV events say what vLLM's own say of it; empty: none."""
    deadline_s: float | None = None
    """Loads: the longest the load may take from its start on the worker; past it, the blocks that did not
    arrive are reported failed (vLLM recomputes them). None: no deadline (the client's timeouts only)."""
    keep: bool = False
    """Stores of a P/D request (connector/planning/handoff.py): the only copy its consumer will have, so the worker
    waits, bounded, for buffer room rather than drop them."""


@dataclass(slots=True)
class StepPlan:
    """The connector metadata of one scheduler step."""

    loads: list[BlockJob] = field(default_factory=list)
    stores: list[BlockJob] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    """Requests preempted this step: their blocks go back to vLLM's free pool before the next forward pass."""
    idle: bool = False
    """Nothing is scheduled this step: the workers may wait for their loads in flight instead of returning."""
    prefetches: list[BlockJob] = field(default_factory=list)
    """Requests not admitted yet whose blocks the workers fetch into host memory now (no block ids: hashes only),
    for their load to find there (connector/worker/prefetch.py)."""
    drops: list[str] = field(default_factory=list)
    """Requests whose prefetched blocks will not be loaded (finished, aborted, or a plan without them): freed."""


@dataclass(slots=True)
class _Request:
    hashes: Sequence[bytes]
    """The request's live block-hash list (it grows as tokens are added)."""
    hash_stride: int
    block_ids: list[list[int]]
    tokens: Sequence[int] = ()
    """The request's live token-id list (vLLM's ``all_token_ids``): a stored block's tokens, for its events."""
    lookup: concurrent.futures.Future[tuple[int, list[LookupSlot]]] | None = None
    present: int = 0
    """Leading blocks the gateway holds (from the lookup): never stored again."""
    stored: int = 0
    """Leading blocks already planned for a store."""
    load_start: int = 0
    load_blocks: int = 0
    lookup_sent: float = 0.0
    lookup_answered: float | None = None
    """When the lookup's answer came (set on the client's loop thread): its round trip, for the cost model."""
    decision: Decision | None = None
    keep: bool = False
    """A producer's P/D request: its stores are not dropped for lack of buffer room (``BlockJob.keep``)."""
    wait_s: float = 0.0
    """A consumer's P/D request: how long its lookup may wait on the gateway for the producer's blocks."""
    counted: bool = False
    """``decision`` is counted in ``PlanStats`` (a prefetch's decision is counted when ``matched_tokens`` takes it)."""
    num_tokens: int = 0
    """The prompt's tokens when the planner first saw it (``arrived`` or ``matched_tokens``): a prefetch leaves the
    last one to compute; the prefill queued ahead of a P/D request counts them."""
    prefetched: bool = False
    """A prefetch was sent for it and no load or drop has taken it yet."""
    arrival: bool = False
    """Its lookup was sent at arrival (``arrived``) and ``matched_tokens`` has not read it yet."""
    asked: int = 0
    """Blocks its lookup asked for."""
    covered: int = 0
    """Leading tokens this engine will not prefill: computed, scheduled, or planned for a load."""

    def answered(self, _future: object) -> None:
        self.lookup_answered = time.monotonic()


@dataclass(slots=True)
class PlanStats:
    """What the cost model decided and what the loads then took (connector/planning/cost.py)."""

    loads: int = 0
    """Hits loaded whole."""
    partial: int = 0
    """Hits of which a prefix was loaded (the rest does not fit the longest wait)."""
    skipped: int = 0
    """Hits not loaded: recomputing was predicted faster."""
    probes: int = 0
    """Hits loaded, with the shortest deadline, to measure a link no load had measured for a half-life."""
    abandoned: int = 0
    """Loads that ran out of their deadline: the blocks that had not arrived were recomputed."""
    abandoned_lookups: int = 0
    """Lookups with no answer within the lookup deadline: a miss, never a wait."""
    prefetches: int = 0
    """Requests whose blocks were sent to the workers to fetch before the request was admitted."""
    predicted_load_s: float = 0.0
    """Sum of the predicted times of the loads that ended (compare with ``actual_load_s``)."""
    actual_load_s: float = 0.0
    last_reason: str = ""

    COUNTERS: typing.ClassVar[tuple[str, ...]] = (
        "loads",
        "partial",
        "skipped",
        "probes",
        "abandoned",
        "abandoned_lookups",
        "prefetches",
        "predicted_load_s",
        "actual_load_s",
    )

    def counters(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.COUNTERS}


class KeyScheme:
    """Block paths for a run: the paths every writer rank uses, for lookups (one group index per KV group)."""

    def __init__(self, *, namings: Sequence[RunNaming], num_groups: int) -> None:
        if not namings:
            raise ValueError("at least one rank's naming is needed")
        self.namings = list(namings)
        self.num_groups = num_groups

    @property
    def keys_per_block(self) -> int:
        return len(self.namings) * self.num_groups

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        """Block-major: for each block, every (rank, group) path; a block is present when all of them are."""
        return [
            block_path(namespace=n.namespace, rank=n.rank, block_hash=h, group=g)
            for h in hashes
            for n in self.namings
            for g in range(self.num_groups)
        ]


class SchedulerPlanner:
    def __init__(
        self,
        *,
        client: BlockClient,
        keys: KeyScheme,
        block_size: int,
        hash_block_size: int,
        lookup_wait_s: float = 0.02,
        load_enabled: bool = True,
        store_enabled: bool = True,
        cost: CostModel | None = None,
        block_bytes: int = 0,
        lookup_deadline_s: float | None = None,
        lookup_enabled: bool = True,
        prefetch_enabled: bool = False,
    ) -> None:
        """``cost``: decides per request how much of a hit to load, and its deadline (None: all, no deadline);
        ``block_bytes``: a whole block's bytes over every rank and group, for it. ``lookup_deadline_s``: a lookup
        with no answer by then is a miss (plus a P/D request's wait). ``lookup_enabled`` False (a ``kv_producer``):
        no lookups, every full block is stored. ``prefetch_enabled``: ``arrived`` looks a request up at once and its
        load share is prefetched (``StepPlan.prefetches``)."""
        if block_size % hash_block_size:
            raise ValueError(f"block size {block_size} is not a multiple of the hash block size {hash_block_size}")
        self.client = client
        self.keys = keys
        self.block_size = block_size
        self.hash_stride = block_size // hash_block_size
        self.lookup_wait_s = lookup_wait_s
        self.load_enabled = load_enabled
        self.store_enabled = store_enabled
        self.lookup_enabled = lookup_enabled
        self.prefetch_enabled = prefetch_enabled and load_enabled and lookup_enabled
        self._arrivals: set[str] = set()
        """Requests looked up at arrival whose answer neither ``build`` nor ``matched_tokens`` has read yet."""
        self._requests: dict[str, _Request] = {}
        self._lookups: set[concurrent.futures.Future[tuple[int, list[LookupSlot]]]] = set()
        """Lookups whose answer ``matched_tokens`` has not read yet (an idle step waits on them)."""
        self.lookup_waits = 0
        """Idle steps that waited for a lookup in flight."""
        self.cost = cost
        self.block_bytes = block_bytes
        self.lookup_deadline_s = lookup_deadline_s
        self.stats = PlanStats()
        self._reported: dict[str, float] = {}
        self._last_step: tuple[float, int] | None = None
        """(when, tokens) of the last step with work: the next step's start times it (the prefill rate)."""
        self._plan = StepPlan()

    def block_hashes(self, hashes: Sequence[bytes]) -> list[bytes]:
        """vLLM's request block hashes at block granularity (the hash of each block's last sub-block)."""
        n = len(hashes) // self.hash_stride
        return [bytes(hashes[(i + 1) * self.hash_stride - 1]) for i in range(n)]

    def _hashes(self, req: _Request, upto: int | None = None) -> list[bytes]:
        """The request's hashes at block granularity: the hash of each block's last sub-block."""
        n = len(req.hashes) // req.hash_stride
        if upto is not None:
            n = min(n, upto)
        return [bytes(req.hashes[(i + 1) * req.hash_stride - 1]) for i in range(n)]

    # -- the hit -------------------------------------------------------------------------------------------

    def matched_tokens(
        self,
        *,
        req_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        num_computed_tokens: int,
        token_ids: Sequence[int] = (),
        keep: bool = False,
        expect: Expected | None = None,
    ) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that kvgate can supply; None while the lookup is in flight.

        ``block_hashes`` and ``token_ids``: the request's live lists (they grow as tokens are added). ``keep``: a
        producer's P/D request (its stores are kept); ``expect``: a consumer's P/D request, whose lookup waits on
        the gateway, bounded, for the blocks its producer named."""
        req = self._requests.get(req_id)
        if req is None:
            req = _Request(hashes=block_hashes, hash_stride=self.hash_stride, block_ids=[], tokens=token_ids, keep=keep)
            self._requests[req_id] = req
        req.num_tokens = req.num_tokens or num_tokens
        req.covered = max(req.covered, num_computed_tokens)
        if not self.lookup_enabled:
            return 0
        if req.lookup is None and not self._look_up(req, expect):
            return 0
        assert req.lookup is not None
        if not req.lookup.done():
            waited = time.monotonic() - req.lookup_sent
            if self.lookup_deadline_s is None or waited < self.lookup_deadline_s + req.wait_s:
                return None  # never waited for here: the step may have work (an idle step waits in ``build``)
            # a slow lookup is a miss, not a wait: the request is computed (its blocks are stored again, at worst)
            req.lookup.cancel()
            self._lookups.discard(req.lookup)
            self.stats.abandoned_lookups += 1
            if self.cost is not None:
                self.cost.observe_lookup(seconds=waited - req.wait_s)
            log.warning("lookup of req=%s unanswered after %.3fs: a miss", req_id, waited)
            return 0
        self._lookups.discard(req.lookup)
        self._arrivals.discard(req_id)
        try:
            prefix, _ = req.lookup.result()
        except concurrent.futures.CancelledError:
            return 0
        except ConnectorError as exc:
            log.warning("lookup failed req=%s: %s", req_id, exc)
            return 0
        if self.cost is not None and req.lookup_answered is not None and not req.wait_s:
            # a P/D request's lookup waited on the gateway for its producer's stores: not a round trip
            self.cost.observe_lookup(seconds=max(0.0, req.lookup_answered - req.lookup_sent))
        req.lookup_answered = None  # counted once
        if req.arrival:
            req.arrival = False
            if prefix < req.asked * self.keys.keys_per_block and self._look_up(req, expect):
                # not all of it at arrival: blocks stored since (by a request ahead of it) may be there now, so it
                # is looked up again, as it would have been without the arrival's lookup
                return None
        req.present = prefix // self.keys.keys_per_block
        req.stored = max(req.stored, req.present)
        if not self.load_enabled:
            return 0
        local = num_computed_tokens // self.block_size
        hit_blocks = self._loadable(req.present, num_tokens=num_tokens)
        extra = max(0, hit_blocks - local)
        if extra and self.cost is not None:
            extra = self._decide(req_id, req, extra)
        req.load_start, req.load_blocks = local, extra
        req.covered = max(req.covered, (local + extra) * self.block_size)
        return extra * self.block_size if extra else 0

    def looked_up(self, req_id: str) -> bool:
        """``req_id``'s lookup was sent (a P/D request's wait is decided before that, once)."""
        req = self._requests.get(req_id)
        return req is not None and req.lookup is not None

    def handoff_wait_s(self, *, req_id: str, tokens: int, most_s: float) -> float:
        """How long a consumer's P/D request may wait for its producer's blocks: ``most_s``, and never longer than
        the cost model predicts its recompute would take on this engine now. That is its own ``tokens`` after the
        prefill queued ahead of it: every request this planner tracks, first come first served, that has tokens it
        will neither compute nor load yet (a request ahead still waiting for its own handoff counts whole: it is
        recomputed if its blocks do not come). With 16 handoffs at once the last may wait for 16 prefills, where a
        cap of one request's recompute gave up on producers' stores still in flight. No prefill rate measured yet:
        ``most_s``."""
        if self.cost is None:
            return most_s
        ahead = sum(max(0, r.num_tokens - r.covered) for k, r in self._requests.items() if k != req_id)
        wait_s = min(most_s, self.cost.predict_recompute_s(tokens=tokens + ahead))
        log.debug("req=%s waits up to %.3fs for its handoff (%d tokens, %d ahead)", req_id, wait_s, tokens, ahead)
        return wait_s

    def _loadable(self, present: int, *, num_tokens: int) -> int:
        """The leading blocks of ``present`` a prompt of ``num_tokens`` can load: vLLM computes at least the last
        token."""
        return min(present, max(0, (num_tokens - 1) // self.block_size))

    def _look_up(self, req: _Request, expect: Expected | None) -> bool:
        """Start ``req``'s one lookup; False when it has no full block."""
        hashes = self._hashes(req)
        if not hashes:
            return False
        want = None
        if expect is not None and self.load_enabled:
            req.wait_s, want = expect.wait_s, min(expect.blocks, len(hashes)) * self.keys.keys_per_block
        req.lookup_sent, req.asked = time.monotonic(), len(hashes)
        lookup = self.client.lookup(self.keys.keys(hashes), wait_s=req.wait_s, min_prefix=want)
        req.lookup = self.client.submit(lookup)
        req.lookup.add_done_callback(req.answered)
        self._lookups.add(req.lookup)
        return True

    def arrived(self, *, req_id: str, block_hashes: Sequence[bytes], num_tokens: int, token_ids: Sequence[int]) -> None:
        """vLLM first sees the request (``on_new_request``): with prefetch on, its lookup starts now (the one
        ``matched_tokens`` would start), and once it is answered ``build`` sends the load the cost model would plan
        to the workers as a prefetch. Not for a P/D request (its lookup waits for its producer's blocks)."""
        if not self.prefetch_enabled or req_id in self._requests:
            return
        req = _Request(hashes=block_hashes, hash_stride=self.hash_stride, block_ids=[], tokens=token_ids)
        req.num_tokens = num_tokens
        self._requests[req_id] = req
        if self._look_up(req, None):
            req.arrival = True
            self._arrivals.add(req_id)

    def _prefetch(self) -> None:
        """The answered arrival lookups: a prefetch of each load share the cost model plans (decided, not counted:
        ``matched_tokens`` counts it when it takes the decision)."""
        for req_id in [r for r in self._arrivals if (q := self._requests.get(r)) and q.lookup and q.lookup.done()]:
            self._arrivals.discard(req_id)
            req = self._requests[req_id]
            assert req.lookup is not None
            self._lookups.discard(req.lookup)  # read: an idle step no longer waits on it
            if req.lookup.cancelled() or req.lookup.exception() is not None:
                continue
            present = req.lookup.result()[0] // self.keys.keys_per_block
            hit = self._loadable(present, num_tokens=req.num_tokens)
            blocks = self._decide(req_id, req, hit, count=False) if hit else 0
            if req.decision is not None and req.decision.verdict is Verdict.PROBE:
                continue  # a probe measures the link: its bytes must cross it while timed
            if blocks:
                hashes = tuple(self._hashes(req, upto=blocks))
                self._plan.prefetches.append(BlockJob(req_id=req_id, hashes=hashes, block_ids=()))
                req.prefetched = True
                self.stats.prefetches += 1

    def _decide(self, req_id: str, req: _Request, extra: int, *, count: bool = True) -> int:
        """The cost model's share of a hit of ``extra`` blocks (decided once per request, counted once)."""
        if self.cost is None:
            return extra
        if req.decision is None or req.decision.hit_blocks != extra:
            req.counted = False
            req.decision = d = self.cost.plan(
                hit_blocks=extra, block_tokens=self.block_size, block_bytes=self.block_bytes, now=time.monotonic()
            )
            log.debug(
                "req=%s %s %d of %d blocks: %s (load %.3fs, recompute %.3fs, deadline %.3fs)",
                req_id,
                d.verdict,
                d.blocks,
                d.hit_blocks,
                d.reason,
                d.predicted_load_s,
                d.predicted_recompute_s,
                d.deadline_s,
            )
        if count and not req.counted:
            req.counted = True
            d = req.decision
            if d.verdict is Verdict.LOAD:
                self.stats.loads += 1
            elif d.verdict is Verdict.PARTIAL:
                self.stats.partial += 1
            elif d.verdict is Verdict.PROBE:
                self.stats.probes += 1
            else:
                self.stats.skipped += 1
            self.stats.last_reason = d.reason
        return req.decision.blocks

    def loaded(self, *, req_id: str, outcome: LoadOutcome) -> None:
        """What a load measured (the workers' report): into the bandwidth estimate, a miss included."""
        req = self._requests.get(req_id)
        if outcome.expired:
            self.stats.abandoned += 1
        self.stats.actual_load_s += outcome.seconds
        if req is not None and req.decision is not None:
            self.stats.predicted_load_s += req.decision.predicted_load_s
        if self.cost is not None and outcome.measures_link:  # prefetched bytes crossed the link before it was timed
            self.cost.observe_load(nbytes=outcome.nbytes, seconds=outcome.seconds, now=time.monotonic())

    def after_alloc(self, *, req_id: str, block_ids: Sequence[Sequence[int]], num_external_tokens: int) -> None:
        req = self._requests.get(req_id)
        if req is None:
            return
        req.block_ids = [list(ids) for ids in block_ids]
        loads = len(self._plan.loads)
        if num_external_tokens > 0 and req.load_blocks > 0:
            start, count = req.load_start, num_external_tokens // self.block_size
            hashes = self._hashes(req, upto=start + count)[start:]
            ids = tuple(tuple(g[start : start + len(hashes)]) for g in req.block_ids)
            if hashes and all(len(g) == len(hashes) for g in ids):
                deadline = None if req.decision is None or req.decision.blocks == 0 else req.decision.deadline_s
                job = BlockJob(req_id=req_id, hashes=tuple(hashes), block_ids=ids, deadline_s=deadline)
                self._plan.loads.append(job)
            req.load_blocks = 0
        if req.prefetched:  # a load takes the prefetched blocks and frees them; without one they are dropped
            req.prefetched = False
            if len(self._plan.loads) == loads:
                self._plan.drops.append(req_id)

    # -- the step ------------------------------------------------------------------------------------------

    def scheduled(
        self,
        *,
        req_id: str,
        new_block_ids: Sequence[Sequence[int]] | None,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        replace: bool = False,
    ) -> None:
        """A request ran this step: blocks that become full by its end are planned for a store."""
        req = self._requests.get(req_id)
        if req is None:
            return
        req.covered = max(req.covered, num_computed_tokens + num_scheduled_tokens)
        if new_block_ids is not None:
            if replace or not req.block_ids:
                req.block_ids = [list(ids) for ids in new_block_ids]
            else:
                for have, more in zip(req.block_ids, new_block_ids, strict=True):
                    have.extend(more)
        if not self.store_enabled or not req.block_ids:
            return
        full = (num_computed_tokens + num_scheduled_tokens) // self.block_size
        hashes = self._hashes(req, upto=min(full, *(len(g) for g in req.block_ids)))
        if len(hashes) <= req.stored:
            return
        start = req.stored
        ids = tuple(tuple(g[start : len(hashes)]) for g in req.block_ids)
        metas = tuple(self._meta(req, hashes, i) for i in range(start, len(hashes)))
        job = BlockJob(req_id=req_id, hashes=tuple(hashes[start:]), block_ids=ids, metas=metas, keep=req.keep)
        self._plan.stores.append(job)
        req.stored = len(hashes)

    def _meta(self, req: _Request, hashes: Sequence[bytes], i: int) -> str | None:
        """Block ``i``'s meta: its tokens and the hash of block ``i - 1``, as vLLM's BlockStored has them."""
        end = (i + 1) * self.block_size
        tokens = req.tokens[end - self.block_size : end] if len(req.tokens) >= end else ()
        return format_block_meta(parent=hashes[i - 1] if i else None, tokens=tokens)

    def preempted(self, req_ids: Iterable[str]) -> None:
        self._plan.preempted.extend(req_ids)

    def build(self, *, idle: bool = False) -> StepPlan:
        """The step's plan. ``idle``: nothing is scheduled this step; wait up to ``lookup_wait_s`` for a lookup in
        flight first (the engine has nothing else to do), and let the workers wait for their loads."""
        if idle:
            self.wait_for_lookups(timeout_s=self.lookup_wait_s)
        if self._arrivals:
            self._prefetch()
        plan, self._plan = self._plan, StepPlan()
        plan.idle = idle
        return plan

    def report(self) -> dict[str, float]:
        """What changed since the last report (counters), and the estimates now (``bandwidth_mib_s``,
        ``prefill_tokens_s``); empty when nothing was decided or measured since."""
        now = self.stats.counters()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items() if v != self._reported.get(k, 0)}
        self._reported = now
        if delta and self.cost is not None:
            delta["bandwidth_mib_s"] = self.cost.bandwidth(now=time.monotonic()) / MIB
            delta["prefill_tokens_s"] = self.cost.prefill.value
        return delta

    def step(self, *, tokens: int) -> None:
        """A step is being built with ``tokens`` scheduled: the time since the last step with work times it (the
        engine's prefill rate, for the cost model; idle steps and decode-sized ones are not counted)."""
        now = time.monotonic()
        if self.cost is not None and self._last_step is not None:
            when, last_tokens = self._last_step
            self.cost.observe_step(tokens=last_tokens, seconds=now - when)
        self._last_step = (now, tokens) if tokens > 0 else None

    def wait_for_lookups(self, *, timeout_s: float) -> bool:
        """Wait (GIL released) until a lookup in flight completes, at most ``timeout_s``; False when none was in
        flight, or one already has an answer that the next step will read."""
        if not self._lookups or timeout_s <= 0 or any(f.done() for f in self._lookups):
            return False
        self.lookup_waits += 1
        concurrent.futures.wait(self._lookups, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)
        return True

    def stored_hashes(self, req_id: str) -> list[bytes]:
        """The hashes of ``req_id``'s leading blocks planned for a store (a producer names them to its consumer)."""
        req = self._requests.get(req_id)
        return [] if req is None else self._hashes(req, upto=req.stored)

    def finished(self, req_id: str) -> bool:
        """Forget ``req_id``; True when stores were planned for it (its blocks must outlive their copies)."""
        req = self._requests.pop(req_id, None)
        self._arrivals.discard(req_id)
        if req is None:
            return False
        if req.prefetched:
            self._plan.drops.append(req_id)
        if req.lookup is not None:
            req.lookup.cancel()
            self._lookups.discard(req.lookup)
        return req.stored > req.present

    @property
    def tracked(self) -> int:
        return len(self._requests)
