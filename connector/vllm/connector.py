"""KVGateConnector: vLLM's ``KVConnectorBase_V1`` mapped onto connector.planning.plan (scheduler) and
connector.worker.pipeline (worker). The only module that imports vllm; everything it decides is in those plain,
vLLM-free classes.

    --kv-transfer-config '{"kv_connector":"KVGateConnector","kv_connector_module_path":"connector.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"url":"http://127.0.0.1:8750"}}'

Loads are asynchronous: ``get_num_new_matched_tokens`` answers from one ``POST /v1/lookup`` per request (``None``
while it is in flight), the worker fetches and scatters between steps and reports the request in ``get_finished``;
blocks that could not be loaded are reported by ``get_block_ids_with_load_errors`` and vLLM recomputes them. How
much of a hit is loaded, and by when, is the cost model's call (connector/planning/cost.py): every load has a
deadline, past which the blocks that did not arrive are reported so; what each load measured comes back to the
scheduler in ``KVGateWorkerMetadata`` and its decisions go out in vLLM's KV transfer stats (``KVGateStats``) and its
Prometheus metrics (connector/vllm/metrics.py, docs/connector-metrics.md). A step with work never waits on the network.
A step with nothing scheduled waits, bounded, for a lookup (``build_connector_meta``) or a load (``get_finished``) in
flight instead of returning at once: the engine would step again at once, thousands of times a second, holding the
GIL and a core that the loads need. With ``prefetch_budget_mib``, ``on_new_request`` starts the lookup and the
workers read the hit into host memory before the request is admitted (connector/worker/prefetch.py). Stores are
best effort: a block that does not fit the bounded buffers is dropped and counted.

Roles (``kv_role``): a ``kv_producer`` stores and never looks up or loads; a ``kv_consumer`` looks up and loads
and never stores (nor writes the namespace's config); ``kv_both`` does both. Prefill/decode disaggregation
(connector/planning/handoff.py): a producer's P/D request keeps its stores (the worker waits, bounded, for buffer
room) and its ``request_finished`` returns ``kv_transfer_params`` naming its blocks; a consumer given them waits on the
gateway, bounded by ``handoff_wait_ms``, for those blocks, then loads them (past the wait: what is there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.device.layout import BackendLayout, layer_views
from connector.device.transfer import BlockTransfer
from connector.http.client import BlockClient
from connector.planning.cost import CostModel, LoadOutcome
from connector.planning.handoff import expected, producer_params, wants_handoff
from connector.planning.plan import KeyScheme, SchedulerPlanner, StepPlan
from connector.vllm.layout import check_layers, resolve_layout
from connector.vllm.metrics import KVGatePromMetrics
from connector.vllm.settings import ConnectorSettings
from connector.worker.pipeline import WORKER_GAUGES, WorkerPipeline
from contract.keys import KVGroup, RunNaming, naming

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvgate.connector.vllm")


class KVGateConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vllm is untyped here
    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVGateWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Worker -> scheduler, per step: what the loads that ended measured (for the cost model)."""

    def __init__(self, outcomes: dict[str, LoadOutcome]) -> None:
        self.outcomes = outcomes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KVGateWorkerMetadata):
            return self
        merged = dict(self.outcomes)
        for req_id, outcome in other.outcomes.items():
            merged[req_id] = merged[req_id].merge(outcome) if req_id in merged else outcome
        return KVGateWorkerMetadata(merged)


RANK_GAUGES = frozenset(WORKER_GAUGES)
"""The workers' gauges (host bytes held), sent per rank: ``{rank: value}``. vLLM calls ``aggregate`` both across
the TP ranks of a step and across the steps of a logging interval, and cannot say which: merging by rank (a rank's
newest value wins) is right for both, and the metric is their sum (``reduce``, connector/vllm/metrics.py)."""

GAUGES = frozenset({"bandwidth_mib_s", "prefill_tokens_s"}) | RANK_GAUGES
"""Of the stats below, the estimates: an interval keeps the latest (per rank for ``RANK_GAUGES``); every other key
is a count, summed (over steps and over ranks)."""


@dataclass
class KVGateStats(KVConnectorStats):  # type: ignore[misc]
    """vLLM's KV transfer stats: the scheduler's cost-model decisions (connector/planning/plan.py:
    ``SchedulerPlanner.report``) and what each worker rank counted (connector/worker/pipeline.py:
    ``WorkerPipeline.report``), in vLLM's periodic "KV Transfer metrics" log and as Prometheus metrics. The two roles'
    keys are disjoint."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            if key in RANK_GAUGES:  # a new dict: the one in ``self.data`` may be another stats object's too
                self.data[key] = {**self.data.get(key, {}), **value}
            elif (
                key in GAUGES
                or not isinstance(value, int | float)
                or not isinstance(self.data.get(key, 0), int | float)
            ):
                self.data[key] = value  # an estimate, or what no count is (a newer connector's): the latest
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            v = sum(v.values()) if k in RANK_GAUGES else v
            if isinstance(v, int | float):  # anything else is a newer connector's: not a number to log
                out[k] = round(v, 3) if isinstance(v, float) else v
        return out

    def is_empty(self) -> bool:
        return not self.data


@dataclass(frozen=True, slots=True)
class RunShape:
    """What naming and planning need from vLLM's configs, as plain values."""

    model_name: str
    dtype: str
    groups: tuple[KVGroup, ...]
    num_kv_heads: int
    total_kv_heads: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    rank: int
    world_size: int
    block_size: int
    hash_block_size: int
    head_size: int
    itemsize: int
    layout: BackendLayout

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole canonical block: all KV heads of all layers of the (single) group."""
        layers = len(self.groups[0].layer_names) if self.groups else 0
        return self.total_kv_heads * layers * 2 * self.block_size * self.head_size * self.itemsize

    def naming(self, rank: int) -> RunNaming:
        return naming(
            model_name=self.model_name,
            tokens_per_hash=self.hash_block_size,
            tp_size=self.tp_size,
            rank=rank,
            dtype=self.dtype,
            groups=self.groups,
            num_kv_heads=self.num_kv_heads,
            total_kv_heads=self.total_kv_heads,
            pp_size=self.pp_size,
            pcp_size=self.pcp_size,
            dcp_size=self.dcp_size,
            block_bytes=self.block_bytes,
            kv_layout=None if self.layout.certified else self.layout.layout_id,
        )

    @property
    def movable(self) -> bool:
        """kvgate moves full-attention groups only (a sliding-window group's early blocks are not kept)."""
        return all(g.full_attention for g in self.groups)


def run_shape(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> RunShape:
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    model, cache, par = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        full = isinstance(spec, FullAttentionSpec) and getattr(spec, "sliding_window", None) is None
        groups.append(
            KVGroup(
                tokens_per_block=spec.block_size,
                layer_names=tuple(group.layer_names),
                full_attention=full,
                mla=isinstance(spec, MLAAttentionSpec),
            )
        )
    first = kv_cache_config.kv_cache_groups[0].kv_cache_spec if kv_cache_config.kv_cache_groups else None
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    dtype = model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype
    head_size = int(getattr(first, "head_size", 0))
    return RunShape(
        model_name=model.model,
        dtype=str(dtype).removeprefix("torch."),
        groups=tuple(groups),
        num_kv_heads=int(getattr(first, "num_kv_heads", 1)),
        total_kv_heads=model.get_total_num_kv_heads(),
        tp_size=par.tensor_parallel_size,
        pp_size=par.pipeline_parallel_size,
        pcp_size=par.prefill_context_parallel_size,
        dcp_size=par.decode_context_parallel_size,
        rank=par.rank,
        world_size=par.world_size,
        block_size=block_size,
        hash_block_size=hash_block_size,
        head_size=head_size,
        itemsize=int(first.dtype.itemsize) if first is not None else 1,
        layout=resolve_layout(vllm_config, first),
    )


def _log_config_failure(future: Any) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("kvgate: namespace config not recorded: %s", future.exception())


class KVGateConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # parsed once: a misspelt key fails here, at start-up (connector/vllm/settings.py)
        self.settings = settings = ConnectorSettings.parse(self._kv_transfer_config.kv_connector_extra_config)
        self.shape = run_shape(vllm_config, kv_cache_config)
        self.naming = self.shape.naming(self.shape.rank)
        if not self.shape.movable:
            log.warning("kvgate: a KV-cache group is not full attention; loads and stores are off")
        self.client = BlockClient(settings.client_config())
        self._load_wait_s = settings.load_wait_ms / 1000
        self.planner: SchedulerPlanner | None = None
        self.pipeline: WorkerPipeline | None = None
        self._loading: set[str] = set()
        self._load_errors: set[int] = set()
        self._load_blocks: dict[str, set[int]] = {}  # scheduler: the blocks each request is loading into
        self._recompute: set[str] = set()  # scheduler: requests whose load failed; vLLM recomputes, never reloads
        transfer_config = self._kv_transfer_config
        self.produces = bool(transfer_config.is_kv_producer)
        """Stores (kv_producer, kv_both)."""
        self.consumes = bool(transfer_config.is_kv_consumer)
        """Looks up and loads (kv_consumer, kv_both)."""
        self.producer_only = self.produces and not self.consumes
        self._handoffs: set[str] = set()  # scheduler: a producer's P/D requests (their finish names their blocks)
        if role == KVConnectorRole.SCHEDULER:
            ranks = [0] if self.naming.parallel_agnostic else list(range(self.shape.world_size))
            self.planner = SchedulerPlanner(
                client=self.client,
                keys=KeyScheme(namings=[self.shape.naming(r) for r in ranks], num_groups=len(self.shape.groups)),
                block_size=self.shape.block_size,
                hash_block_size=self.shape.hash_block_size,
                lookup_wait_s=settings.lookup_wait_ms / 1000,
                load_enabled=self.shape.movable and settings.load and self.consumes,
                store_enabled=self.shape.movable and settings.store and self.produces,
                lookup_enabled=self.consumes,
                cost=CostModel(settings.cost_settings()),
                block_bytes=self.shape.block_bytes * max(1, len(self.shape.groups)),
                lookup_deadline_s=settings.lookup_deadline_ms / 1000,
                prefetch_enabled=settings.prefetch_budget_mib > 0,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a future miss

    # -- scheduler side ------------------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        """Fetch at arrival (connector/worker/prefetch.py): the lookup starts now, not when the scheduler reaches
        the request; a P/D request (``kv_transfer_params``) is looked up as before."""
        if self.planner is not None and not request.kv_transfer_params:
            self.planner.arrived(
                req_id=request.request_id,
                block_hashes=request.block_hashes,
                num_tokens=request.num_tokens,
                token_ids=request.all_token_ids,
            )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.planner is None or request.request_id in self._recompute:
            return 0, False  # a failed load is not retried: the gateway may still list the bad block
        params = request.kv_transfer_params
        keep = self.produces and wants_handoff(params, producer_only=self.producer_only)
        if keep:
            self._handoffs.add(request.request_id)
        expect = None
        if self.consumes and params and not self.planner.looked_up(request.request_id):
            expect = expected(
                params,
                url=self.settings.url,
                namespace=self.naming.namespace,
                block_size=self.shape.block_size,
                hashes=self.planner.block_hashes(request.block_hashes),
                wait_s=self.planner.handoff_wait_s(
                    req_id=request.request_id,
                    tokens=request.num_tokens - num_computed_tokens,
                    most_s=self.settings.handoff_wait_ms / 1000,
                ),
            )
        n = self.planner.matched_tokens(
            req_id=request.request_id,
            block_hashes=request.block_hashes,
            num_tokens=request.num_tokens,
            num_computed_tokens=num_computed_tokens,
            token_ids=request.all_token_ids,  # a stored block's tokens, for the gateway's KV events
            keep=keep,
            expect=expect,
        )
        if n is None:
            return None, False
        return n, n > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.planner is not None:
            if num_external_tokens > 0:
                self._load_blocks[request.request_id] = {b for ids in blocks.get_block_ids() for b in ids}
            self.planner.after_alloc(
                req_id=request.request_id, block_ids=blocks.get_block_ids(), num_external_tokens=num_external_tokens
            )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: a request whose load failed (vLLM reschedules it) gets no external tokens again."""
        bad = set(connector_output.invalid_block_ids or ())
        for req_id, ids in list(self._load_blocks.items()):
            if ids & bad:
                self._recompute.add(req_id)
        for req_id in connector_output.finished_recving or ():
            self._load_blocks.pop(req_id, None)
        meta = connector_output.kv_connector_worker_meta
        if self.planner is not None and isinstance(meta, KVGateWorkerMetadata):
            for req_id, outcome in meta.outcomes.items():
                self.planner.loaded(req_id=req_id, outcome=outcome)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.planner is None:
            return KVGateConnectorMetadata(StepPlan())
        tokens = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.planner.scheduled(
                req_id=new.req_id,
                new_block_ids=new.block_ids,
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=tokens.get(new.req_id, 0),
                replace=True,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self.planner.scheduled(
                req_id=req_id,
                new_block_ids=cached.new_block_ids[i],
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=tokens.get(req_id, 0),
                replace=req_id in cached.resumed_req_ids,
            )
        self.planner.preempted(scheduler_output.preempted_req_ids or ())
        self.planner.step(tokens=scheduler_output.total_num_scheduled_tokens)
        # nothing scheduled: the engine has nothing to do but wait for lookups and loads, so it waits for them
        # (bounded) instead of stepping again at once; a step with work never waits
        return KVGateConnectorMetadata(self.planner.build(idle=scheduler_output.total_num_scheduled_tokens == 0))

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler side: the cost model's decisions since the last call. Worker side (called after each step's
        ``get_finished``; vLLM sums the ranks' stats with ``aggregate``, then with the scheduler's): what this rank
        counted since the last call and the host bytes it holds now, keyed by its rank. vLLM logs and exports
        both (docs/connector-metrics.md)."""
        if self.planner is not None:
            report = self.planner.report()
            return KVGateStats(data=report) if report else None
        if self.pipeline is None:
            return None
        counted = self.pipeline.report()
        if not counted:
            return None
        rank = str(self.shape.rank)
        return KVGateStats(data={k: {rank: v} if k in RANK_GAUGES else v for k, v in counted.items()})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVGateStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVGatePromMetrics:
        """The same stats as Prometheus metrics, ``vllm:kvgate_*`` (connector/vllm/metrics.py)."""
        return KVGatePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.planner is None:
            return False, None
        self._load_blocks.pop(request.request_id, None)
        self._recompute.discard(request.request_id)
        params = None
        if request.request_id in self._handoffs:
            self._handoffs.discard(request.request_id)
            params = producer_params(
                url=self.settings.url,
                namespace=self.naming.namespace,
                block_size=self.shape.block_size,
                hashes=self.planner.stored_hashes(request.request_id),
            )
        return self.planner.finished(request.request_id), params

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # -- worker side ---------------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.shape.movable:
            return
        # a layout other than the one the namespace is named after would store wrong bytes: refuse to start
        check_layers(self._vllm_config, groups=self.shape.groups, layout=self.shape.layout)
        transfers = []
        for group in self.shape.groups:
            layers = {}
            for name in group.layer_names:
                views, layout = layer_views(
                    kv_caches[name],
                    layout=self.shape.layout,
                    num_kv_heads=self.shape.num_kv_heads,
                    block_size=group.tokens_per_block,
                    head_size=self.shape.head_size,
                )
                layers.update({f"{name}#{i}": v for i, v in enumerate(views)})
            transfers.append(
                BlockTransfer(
                    kv_caches=layers,
                    layout=layout,
                    max_blocks_per_batch=self.settings.blocks_per_batch,
                    store_buffers=self.settings.store_buffers,
                    load_buffers=self.settings.load_buffers,
                )
            )
        self.pipeline = WorkerPipeline(
            client=self.client,
            naming=self.naming,
            transfers=transfers,
            tp_size=self.shape.tp_size,
            tp_rank=self.shape.rank % self.shape.tp_size,
            keep_wait_s=self.settings.handoff_store_wait_ms / 1000,
            prefetch_budget_bytes=self.settings.prefetch_budget_mib * 1024 * 1024,
        )
        if (
            self.shape.rank == 0 and self.produces
        ):  # the namespace's fields (format, layout id, block size) for the gateway's checks
            put = self.client.put_config(self.naming.namespace, dict(self.naming.fields))
            self.client.submit(put).add_done_callback(_log_config_failure)

    def _plan(self) -> StepPlan | None:
        if self.pipeline is None or not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVGateConnectorMetadata) else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._plan()
        if plan is None or self.pipeline is None:
            return
        self._loading.update(job.req_id for job in plan.loads)
        self.pipeline.start_prefetches(plan.prefetches, drops=plan.drops)
        self.pipeline.start_loads(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads complete between steps and are reported by get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None  # whole blocks are gathered across layers once the forward is done (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._plan()
        if plan is None or self.pipeline is None:
            return
        self.pipeline.start_stores(plan.stores)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.pipeline is None:
            return
        plan = kv_connector_metadata.plan if isinstance(kv_connector_metadata, KVGateConnectorMetadata) else None
        self.pipeline.before_step(preempted=plan.preempted if plan is not None else ())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.pipeline is None:
            return None, None
        sending = self.pipeline.finished_stores(finished_req_ids)
        recving = set()
        plan = self._plan()
        wait_s = self._load_wait_s if plan is not None and plan.idle else 0.0
        for req_id, failed in self.pipeline.finished_loads(wait_s=wait_s).items():
            recving.add(req_id)
            self._loading.discard(req_id)
            self._load_errors |= failed
        return sending or None, recving or None

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.pipeline is None:
            return None
        outcomes = self.pipeline.take_outcomes()
        return KVGateWorkerMetadata(outcomes) if outcomes else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def has_pending_block_frees(self) -> bool:
        return self.pipeline is not None and self.pipeline.has_pending_frees

    def shutdown(self) -> None:
        if self.pipeline is not None:
            self.pipeline.wait_uploads(timeout_s=30.0)
            self.pipeline.close()
        self.client.close()
