"""Run in the oracle venv: KVGateConnector's Prometheus metrics, built the way vLLM builds them, fed the stats dicts
of two engine steps: a real ``SchedulerPlanner.report()`` each, merged with what two worker-role connectors reported.

vLLM's own ``KVConnectorProm`` (what its ``PrometheusStatLogger`` holds) finds the connector class through the
factory and calls its ``build_prom_metrics`` with prometheus_client's classes; its ``observe`` then gets what the
scheduler sends, ``KVGateStats.to_dict()``. The planner decides for real (connector/planning/cost.py) over a client that
answers lookups at once (no gateway: only its decisions and their counts matter here).

The workers are ``KVGateConnector``s in vLLM's worker role (built through the factory, with KV tensors registered),
playing TP ranks 0 and 1: rank 0's gateway is down (a port nobody listens on), rank 1's is a real one. Each step,
vLLM's model runner takes ``get_kv_connector_stats()`` from each rank; the stats cross the process boundary
(pickled), vLLM's real ``KVOutputAggregator`` merges the ranks', and the scheduler merges its own into them (as
``Scheduler.update_from_output`` does) before ``to_dict()``. vLLM's ``KVConnectorLogging`` gets the same dicts for
its periodic log line.

argv: <gateway url> <model dir>; prints ``RESULT`` and one JSON object: the step dicts, what
``build_prom_metrics`` returned, the ``generate_latest()`` text after the two steps and after a quiet one, the log
line's numbers, and the workers' reports once nothing happens.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import pickle
import sys
import time
from collections.abc import Sequence
from typing import Any

import prometheus_client
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from connector.device.pinned import HostBuffer
from connector.planning.cost import MIB, CostModel, CostSettings, LoadOutcome
from connector.planning.plan import BlockJob, KeyScheme, SchedulerPlanner, StepPlan
from connector.vllm.connector import KVGateConnector, KVGateConnectorMetadata, KVGateStats
from contract.keys import KVGroup, naming
from tests.gateway import free_port
from tests.vllm.oracle_connector import configs, kv_tensors

BLOCK = 16
LABELNAMES = ["model_name", "engine"]  # as vLLM's PrometheusStatLogger names them
ENGINES: dict[int, list[object]] = {0: ["tiny", "0"], 1: ["tiny", "1"]}
UNKNOWN = {"stores_dropped_someday": 3, "histogram_someday": [1, 2], "note_someday": "text"}


class InstantClient:
    """Every key is present and answered at once; ``stall``: the next lookups never answer."""

    def __init__(self) -> None:
        self.stall = False

    def lookup(self, keys: Sequence[str], *, wait_s: float = 0.0, min_prefix: int | None = None) -> int | None:
        return None if self.stall else len(keys)

    def submit(self, answer: int | None) -> concurrent.futures.Future[tuple[int, list[Any]]]:
        future: concurrent.futures.Future[tuple[int, list[Any]]] = concurrent.futures.Future()
        if answer is not None:
            future.set_result((answer, []))
        return future


def hit(planner: SchedulerPlanner, req_id: str, blocks: int) -> int | None:
    """A request whose first ``blocks`` blocks the gateway holds (plus one token vLLM must compute)."""
    hashes = [f"{req_id}-{i}".encode() for i in range(blocks)]
    return planner.matched_tokens(
        req_id=req_id, block_hashes=hashes, num_tokens=blocks * BLOCK + 1, num_computed_tokens=0
    )


def reports() -> list[dict[str, float]]:
    run = naming(
        model_name="test-org/tiny",
        tokens_per_hash=BLOCK,
        tp_size=1,
        rank=0,
        dtype="bfloat16",
        groups=[KVGroup(tokens_per_block=BLOCK, layer_names=["l0"], mla=False)],
        num_kv_heads=8,
        total_kv_heads=8,
    )
    client = InstantClient()
    # a block loads in 1 s at the prior bandwidth and recomputes in 0.5 s
    cost = CostModel(CostSettings(bandwidth_prior_bytes_s=1.0 * MIB, prefill_tokens_s=2.0 * BLOCK))
    planner = SchedulerPlanner(
        client=client,  # type: ignore[arg-type]  # what the planner uses of a BlockClient
        keys=KeyScheme(namings=[run], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        cost=cost,
        block_bytes=MIB,
        lookup_deadline_s=0.0,
        prefetch_enabled=True,
    )
    out = []
    # 1: no load measured the link yet, recompute is faster: a probe; it runs out of its deadline (abandoned) and
    # measures 0.5 MiB/s, so the next hit is skipped
    assert hit(planner, "probe", 4) == 4 * BLOCK
    planner.loaded(req_id="probe", outcome=LoadOutcome(loaded=1, nbytes=MIB // 2, seconds=1.0, expired=True))
    assert hit(planner, "skip", 4) == 0
    out.append(planner.report())
    # 2: a fast load lifts the estimate: a short hit loads whole, a long one only what fits the longest wait; a request
    # seen at arrival is prefetched; one lookup never answers
    planner.loaded(req_id="warm", outcome=LoadOutcome(loaded=4, nbytes=1000 * MIB, seconds=1.0, expired=False))
    assert hit(planner, "load", 2) == 2 * BLOCK
    partial = hit(planner, "partial", 2000)
    assert partial is not None and 0 < partial < 2000 * BLOCK, partial
    planner.loaded(req_id="load", outcome=LoadOutcome(loaded=2, nbytes=2 * MIB, seconds=0.02, expired=False))
    # a request seen on arrival, not admitted yet: its load share is prefetched
    early = [f"early-{i}".encode() for i in range(2)]
    planner.arrived(req_id="early", block_hashes=early, num_tokens=2 * BLOCK + 1, token_ids=())
    assert [j.req_id for j in planner.build().prefetches] == ["early"]
    client.stall = True
    assert hit(planner, "stalled", 2) == 0
    out.append(planner.report())
    return out


def worker(url: str, model_dir: str, rank: int) -> KVGateConnector:
    vc, kc = configs(url, model_dir)
    conn = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kc)
    assert isinstance(conn, KVGateConnector)
    conn.shape = dataclasses.replace(conn.shape, rank=rank)  # the rank it plays (its stats are keyed by it)
    conn.register_kv_caches(kv_tensors(rank))
    return conn


def step(conn: KVGateConnector, plan: StepPlan) -> None:
    """The worker's hooks of one engine step, as vLLM's model runner calls them."""
    conn.bind_connector_metadata(KVGateConnectorMetadata(plan))
    conn.start_load_kv(None)
    conn.wait_for_save()
    conn.clear_connector_metadata()


def job(req_id: str, salt: str, block_ids: Sequence[int]) -> BlockJob:
    hashes = tuple(f"{salt}-{i}".encode().ljust(32, b".") for i in range(len(block_ids)))
    return BlockJob(req_id=req_id, hashes=hashes, block_ids=(tuple(block_ids),))


def engine_stats(workers: Sequence[KVGateConnector], scheduler: dict[str, float] | None) -> dict[str, Any] | None:
    """What the scheduler sends vLLM's loggers for one step: each rank's stats, pickled across to the engine core,
    merged by vLLM's ``KVOutputAggregator``, then with the scheduler's own stats."""
    outputs = [
        pickle.loads(
            pickle.dumps(
                ModelRunnerOutput.with_kv_conn_output_only(
                    KVConnectorOutput(kv_connector_stats=w.get_kv_connector_stats())
                )
            )
        )
        for w in workers
    ]
    merged = KVOutputAggregator(expected_finished_count=len(workers)).aggregate(outputs)
    stats = merged.kv_connector_output.kv_connector_stats if merged.kv_connector_output else None
    if scheduler:
        own = KVGateStats(data=dict(scheduler))
        stats = stats.aggregate(own) if stats is not None else own
    return None if stats is None else dict(stats.to_dict())


def hold_all(pool: Any) -> list[HostBuffer]:
    held = []
    while (buffer := pool.try_acquire()) is not None:
        held.append(buffer)
    return held


def worker_steps(url: str, model_dir: str, r1: dict[str, float], r2: dict[str, float]) -> dict[str, Any]:
    down = worker(f"http://127.0.0.1:{free_port()}", model_dir, rank=0)
    up = worker(url, model_dir, rank=1)
    assert down.pipeline is not None and up.pipeline is not None
    workers = (down, up)
    store_pool, up_load = down.pipeline.transfers[0].store_pool, up.pipeline.transfers[0].load_pool
    # step 1: rank 0 finds every store buffer in use (its 4 blocks dropped); rank 1 stores 3 blocks and then holds
    # a load buffer
    held = hold_all(store_pool)
    step(down, StepPlan(stores=[job("a", "a", [0, 1, 2, 3])]))
    step(up, StepPlan(stores=[job("b", "b", [0, 1, 2])]))
    up.pipeline.wait_uploads(60)
    up_held = up_load.try_acquire()
    assert up_held is not None
    p1 = engine_stats(workers, r1)
    # step 2: rank 0's buffers back, its 2-block store fails (the gateway is down) and it holds a load buffer;
    # rank 1 loads its 3 blocks back
    for buffer in held:
        buffer.release()
    step(down, StepPlan(stores=[job("c", "c", [4, 5])]))
    down.pipeline.wait_uploads(60)
    down_held = down.pipeline.transfers[0].load_pool.try_acquire()
    assert down_held is not None
    step(up, StepPlan(loads=[job("r", "b", [10, 11, 12])]))
    deadline, recving = time.monotonic() + 60, set[str]()
    while not recving and time.monotonic() < deadline:
        recving |= up.get_finished(set())[1] or set()
        time.sleep(0.01)
    assert recving == {"r"} and not up.get_block_ids_with_load_errors()
    p2 = engine_stats(workers, r2)
    # step 3: the held buffers back; the next report says 0, the one after says nothing
    down_held.release()
    up_held.release()
    p3 = engine_stats(workers, None)
    again = [w.get_kv_connector_stats() for w in workers]
    for w in workers:
        w.shutdown()
    return {
        "steps": [p1, p2, p3],
        "again": [None if s is None else s.to_dict() for s in again],
        "store_buffers": store_pool.size,
        "store_buffer_bytes": store_pool.buffer_bytes,
        "load_buffer_bytes": up_load.buffer_bytes,
        "block_bytes": up.shape.block_bytes,
    }


def main() -> None:
    url, model_dir = sys.argv[1:3]
    r1, r2 = reports()
    got = worker_steps(url, model_dir, r1, r2)
    p1, p2, p3 = got["steps"]
    kt = KVTransferConfig(
        kv_connector="KVGateConnector",
        kv_connector_module_path="connector.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"url": "http://127.0.0.1:1"},
    )
    prom = KVConnectorProm(
        VllmConfig(kv_transfer_config=kt, device_config=DeviceConfig(device="cpu")), LABELNAMES, ENGINES
    )
    logging = KVConnectorLogging(kt)
    logged: list[str] = []
    # what the scheduler sends vLLM's loggers: the stats object's dict
    for payload in (p1, {**p2, **UNKNOWN}):
        prom.observe(payload, 0)
        logging.observe(payload)
    prom.observe(dict(p2), 7)  # an engine it was not built for: ignored
    logging.log(log_fn=lambda fmt, *args: logged.append(fmt % args))
    built = prom.prom_metrics
    text = prometheus_client.generate_latest().decode()
    if p3 is not None:  # as vLLM: a step with no stats observes nothing
        prom.observe(p3, 0)
    quiet = prometheus_client.generate_latest().decode()
    out = {
        "built": None if built is None else type(built).__name__,
        "reports": [r1, r2],
        "steps": [p1, p2, p3],
        "again": got["again"],
        "text": text,
        "quiet": quiet,
        "logged": logged,
        **{k: got[k] for k in ("store_buffers", "store_buffer_bytes", "load_buffer_bytes", "block_bytes")},
    }
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
