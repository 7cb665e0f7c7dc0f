"""KVGateConnector's Prometheus metrics: the cost model's decisions (``SchedulerPlanner.report``) as vLLM metrics.

vLLM builds them once per logger through ``KVGateConnector.build_prom_metrics``, with its own metric classes (plain
prometheus_client, or Ray's wrappers), label names (``model_name``, ``engine``) and per-engine label values, and
hands every scheduler step's stats dict to ``observe``: the scheduler's report merged with the worker ranks'
(``WorkerPipeline.report``: stores, loads, drops; summed over the ranks). A stats dict holds what changed since the
last report (counts, added to counters) and the estimates now (set on gauges; the workers' host bytes held come per
rank, ``{rank: bytes}``, and the gauge is the sum of each rank's newest); a key this module does not know is
ignored, so a newer connector runs against an older dashboard. docs/connector-metrics.md says how to read them.
"""

from __future__ import annotations

import math
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from connector.planning.cost import Verdict

PREFIX = "vllm:kvgate_"

DECISIONS: dict[str, str] = {
    "loads": Verdict.LOAD,
    "partial": Verdict.PARTIAL,
    "skipped": Verdict.SKIP,
    "probes": Verdict.PROBE,
    "abandoned": "abandoned",
}
"""Report key -> the ``verdict`` label of ``vllm:kvgate_decisions_total``. "abandoned" is what became of a load
(load, partial or probe) that ran out of its deadline, counted when it ended."""

COUNTERS: dict[str, tuple[str, str]] = {
    "abandoned_lookups": (
        "abandoned_lookups",
        "Lookups with no answer within the lookup deadline: a miss, never a wait.",
    ),
    "prefetches": (
        "prefetches_planned",
        "Requests whose load share was sent to the workers to fetch into host memory before they were admitted.",
    ),
    "predicted_load_s": (
        "predicted_load_seconds",
        "Sum of the cost model's predicted times of the loads that ended (compare with vllm:kvgate_load_seconds).",
    ),
    "actual_load_s": (
        "load_seconds",
        "Sum of the times the loads that ended took, on the slowest worker rank.",
    ),
}
"""Report key -> (metric name after the prefix, its help): counts, summed. A counter's exposed name ends in
``_total``."""

STORE_DROPS: dict[str, str] = {
    "store_drops_budget": "budget",
    "store_drops_buffer": "buffer",
    "store_drops_full": "gateway_full",
    "store_drops_failed": "failed",
}
"""Worker report key -> the ``reason`` label of ``vllm:kvgate_stores_dropped_total`` (blocks, over every rank):
no room in the client's budget of bytes in flight, no free store buffer, the gateway refused it as full (507), the
PUT failed (the gateway down or unreachable, a timeout, an error answer)."""

WORKER_COUNTERS: dict[str, tuple[str, str]] = {
    "stored_blocks": ("stored_blocks", "Blocks the workers stored (summed over the TP ranks: each stores its part)."),
    "stored_bytes": ("stored_bytes", "Bytes the workers stored, over every rank."),
    "loaded_blocks": ("loaded_blocks", "Blocks the workers loaded into the KV cache (summed over the TP ranks)."),
    "loaded_bytes": ("loaded_bytes", "Bytes the workers read from the gateway and checked, over every rank."),
    "dropped_store_requests": (
        "store_requests_dropped",
        "A request's stores of a step that lost blocks for want of room (budget or buffer), per rank.",
    ),
    "dropped_handoff_blocks": (
        "handoff_blocks_dropped",
        "P/D producer blocks dropped after waiting for room (their consumer recomputes them), over every rank.",
    ),
    "handoff_store_waits": (
        "handoff_store_waits",
        "Times a P/D producer's store held its step waiting for buffer room, over every rank.",
    ),
    "expired_loads": ("worker_expired_loads", "Loads that ran out of their deadline, counted on each rank."),
    "load_failed_blocks": (
        "load_failed_blocks",
        "Blocks not loaded (a miss, an error, a corrupt read, the deadline): vLLM recomputed them; over every rank.",
    ),
    "corrupt_reads": (
        "corrupt_reads",
        "Reads refused: bytes that did not match their checksum or size (a miss, never loaded), over every rank.",
    ),
    "prefetch_started": (
        "prefetches_started",
        "Requests whose blocks a rank started fetching at arrival, into host memory, counted on each rank.",
    ),
    "prefetch_blocks": ("prefetched_blocks", "Blocks fetched at arrival (GETs started), summed over the ranks."),
    "prefetch_used": (
        "prefetches_used",
        "Requests whose load took blocks fetched at arrival instead of reading them, counted on each rank.",
    ),
    "prefetch_dropped": (
        "prefetches_dropped",
        "Requests whose blocks fetched at arrival were freed unused (finished, aborted, not loaded), on each rank.",
    ),
    "prefetch_hits": (
        "prefetch_hits",
        "Loads all of whose blocks were in host memory, read and verified, when the request was admitted; per rank.",
    ),
    "prefetch_overflows": (
        "prefetch_overflows",
        "Prefetches cut short or not started because the rank's prefetch budget was full, counted on each rank.",
    ),
}
"""Worker report key -> (metric name after the prefix, its help): the worker ranks' counts, summed."""

RANK_GAUGES: dict[str, tuple[str, str]] = {
    "store_bytes_held": (
        "store_host_bytes_held",
        "Host bytes of store buffers in use now (blocks gathered, upload not ended), summed over the ranks.",
    ),
    "load_bytes_held": (
        "load_host_bytes_held",
        "Host bytes of load buffers in use now (blocks read or being read, not yet scattered), summed over the ranks.",
    ),
    "prefetch_bytes_held": (
        "prefetch_host_bytes_held",
        "Host bytes held for blocks fetched at arrival, until their load or their drop, summed over the ranks.",
    ),
}
"""Worker report key -> (metric name after the prefix, its help): bytes each rank holds now, ``{rank: bytes}``;
the gauge is the sum of each rank's newest value."""

GAUGES: dict[str, tuple[str, str]] = {
    "bandwidth_mib_s": (
        "bandwidth_mib_s",
        "The cost model's estimate of the load bandwidth (MiB/s) the next load will get.",
    ),
    "prefill_tokens_s": (
        "prefill_tokens_s",
        "The cost model's estimate of the engine's prefill rate (tokens/s); 0: unknown (no setting, none measured).",
    ),
}
"""Report key -> (metric name after the prefix, its help): estimates, the latest kept."""


def _number(value: Any) -> float | None:
    """A finite int or float (not a bool); None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class KVGatePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vllm is untyped here
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        engines = self.per_engine_labelvalues.items()
        decisions = self._counter_cls(
            name=f"{PREFIX}decisions",
            documentation="The cost model's decisions per hit (verdict: load, partial, skip, probe), and the loads "
            "that ran out of their deadline (verdict: abandoned).",
            labelnames=[*labelnames, "verdict"],
        )
        # every count exists from the start, at 0: rate() and the shares work before the first of each verdict
        self._counters: dict[int, dict[str, Any]] = {
            idx: {key: decisions.labels(*values, verdict) for key, verdict in DECISIONS.items()}
            for idx, values in engines
        }
        dropped = self._counter_cls(
            name=f"{PREFIX}stores_dropped",
            documentation="Blocks not stored, over every worker rank, by reason: budget (the client's bytes in "
            "flight), buffer (no free store buffer), gateway_full (507), failed (the gateway down, an error).",
            labelnames=[*labelnames, "reason"],
        )
        for idx, values in engines:
            self._counters[idx].update({key: dropped.labels(*values, why) for key, why in STORE_DROPS.items()})
        for key, (name, doc) in (COUNTERS | WORKER_COUNTERS).items():
            counter = self._counter_cls(name=f"{PREFIX}{name}", documentation=doc, labelnames=labelnames)
            for idx, values in engines:
                self._counters[idx][key] = counter.labels(*values)
        # an engine's estimates appear with its first report: a 0 before it would read as a dead link
        self._gauge_metrics = {
            key: self._gauge_cls(
                name=f"{PREFIX}{name}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
            )
            for key, (name, doc) in (GAUGES | RANK_GAUGES).items()
        }
        self._gauges: dict[int, dict[str, Any]] = {idx: {} for idx, _ in engines}
        self._ranks: dict[int, dict[str, dict[str, float]]] = {idx: {} for idx, _ in engines}
        """Engine -> rank gauge key -> rank -> its newest value (a rank reports only while it holds or changed)."""
        for idx, _ in engines:  # bytes held exist from the start: 0 is what a rank holds before its first transfer
            for key in RANK_GAUGES:
                self._gauge(idx, key).set(0)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        counters = self._counters.get(engine_idx)
        if counters is None:
            return  # an engine it was not built for
        for key, raw in transfer_stats_data.items():
            if key in RANK_GAUGES:
                if isinstance(raw, dict):
                    ranks = self._ranks[engine_idx].setdefault(key, {})
                    ranks.update({str(r): v for r, b in raw.items() if (v := _number(b)) is not None})
                    self._gauge(engine_idx, key).set(sum(ranks.values()))
                continue
            value = _number(raw)
            if value is None:
                continue
            if key in counters:
                if value > 0:  # a count since the last report: never negative
                    counters[key].inc(value)
            elif key in GAUGES:
                self._gauge(engine_idx, key).set(value)
            # any other key: a newer connector's, ignored

    def _gauge(self, engine_idx: int, key: str) -> Any:
        gauges = self._gauges[engine_idx]
        if key not in gauges:
            gauges[key] = self._gauge_metrics[key].labels(*self.per_engine_labelvalues[engine_idx])
        return gauges[key]
