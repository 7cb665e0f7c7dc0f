"""What tests/engine/driver.py measures inside an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0), through the
worker's KVGateConnector (``get_kv_transfer_group()``: the worker runs in the driver's process there).

- ``gated``: the step loop with the worker's loads held back (its client's loop is blocked): a request that misses
  runs to its end while another's load is held, and once the loads go on, the loading request needs a bounded number
  of steps (the idle steps wait for the load instead of spinning).
- ``parts``: the load path's parts measured alone, on the blocks the engine loaded: one lookup, the GETs with their
  checks, the scatters into the KV cache (the same bytes into the same blocks), for the benchmark's limit.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from typing import Any

GATE_SAFETY_S = 300.0
"""If the miss has not finished after this long, the gate opens anyway (a hang becomes a failed check)."""


def worker_connector() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def record_loads(conn: Any) -> list[Any]:
    """The load jobs the worker starts from now on (wraps the pipeline's ``start_loads``)."""
    jobs: list[Any] = []
    pipeline = conn.pipeline
    start = pipeline.start_loads

    def recording(batch: Any) -> None:
        jobs.extend(batch)
        start(batch)

    pipeline.start_loads = recording
    return jobs


def gated(llm: Any, params: Any, *, hit: str, miss: str) -> dict[str, Any]:
    """``miss`` runs first; once it decodes, ``hit`` (its prefix is on the gateway) comes in, and the worker's loads
    are held (its client's loop is blocked) until ``miss`` has finished; then they go on. Counts engine steps."""
    from vllm.sampling_params import RequestOutputKind

    conn = worker_connector()
    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.CUMULATIVE  # LLM.generate left it at FINAL_ONLY: outputs every step
    gate = threading.Event()
    safety = threading.Timer(GATE_SAFETY_S, gate.set)  # a hang becomes a failed check, not a stuck test
    loads = record_loads(conn)
    miss_done_while_held: bool | None = None
    outs: dict[str, Any] = {}
    steps = {"before_hit": 0, "while_held": 0, "after_release": 0, "release_to_hit_token": 0}
    hit_token = False
    load_started_while_miss_ran = False
    engine.add_request("miss", miss, params)
    while "miss" not in outs and not any(o.request_id == "miss" for o in _step(engine, outs)):
        steps["before_hit"] += 1  # until the miss has its first token: from here on every step has work
    steps["before_hit"] += 1
    conn.client.loop.call_soon_threadsafe(gate.wait)  # the worker's GETs and scatters wait for the gate
    safety.start()
    engine.add_request("hit", hit, params)
    while engine.has_unfinished_requests():
        released = gate.is_set()
        got = _step(engine, outs)
        steps["after_release" if released else "while_held"] += 1
        if released and not hit_token:
            steps["release_to_hit_token"] += 1  # the steps from the loads' release to H's first token
            hit_token = any(o.request_id == "hit" for o in got)
        if loads and not load_started_while_miss_ran:
            load_started_while_miss_ran = "miss" not in outs
        if "miss" in outs and miss_done_while_held is None:
            miss_done_while_held = not gate.is_set()
            gate.set()  # the miss is done: the loads go on
    safety.cancel()
    return {
        "load_started_while_miss_ran": load_started_while_miss_ran,
        "miss_finished_while_loads_held": bool(miss_done_while_held),
        "steps": steps,
        "load_waits": conn.pipeline.stats.load_waits,
        "outputs": {k: _result(v) for k, v in outs.items()},
    }


def _step(engine: Any, outs: dict[str, Any]) -> list[Any]:
    got = engine.step()
    for out in got:
        if out.finished:
            outs[out.request_id] = out
    return list(got)


def _result(out: Any) -> dict[str, Any]:
    comp = out.outputs[0]
    return {
        "prompt_token_ids": list(out.prompt_token_ids or []),
        "token_ids": list(comp.token_ids),
        "logprobs": [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], comp.token_ids, strict=True)],
    }


def parts(conn: Any, jobs: list[Any], *, repeats: int = 3) -> list[dict[str, Any]]:
    """For each load job: the median of ``repeats`` timings of its lookup, its GETs (with their checks, windows of
    ``blocks_per_batch`` in flight as the loader reads them) and its scatters, each alone; bytes per job."""
    return [_job_parts(conn, job, repeats) for job in jobs]


def _job_parts(conn: Any, job: Any, repeats: int) -> dict[str, Any]:
    client, pipeline = conn.client, conn.pipeline
    transfers = pipeline.transfers
    ranges = [None if (r := pipeline.part_range(t)) is None else r[:2] for t in transfers]
    window = min(t.max_blocks_per_batch for t in transfers)
    n = len(job.hashes)
    keys = [[conn.naming.block(h, g) for g in range(len(transfers))] for h in job.hashes]
    starts = range(0, n, window)

    async def read(start: int, buffers: list[Any]) -> None:
        async def one(i: int, g: int) -> None:
            size = transfers[g].block_bytes()
            view = buffers[g].view[(i - start) * size : (i - start + 1) * size]
            if not await client.get_into(keys[i][g], view, byte_range=ranges[g]):
                raise RuntimeError(f"probe: block {keys[i][g]} did not read")

        await asyncio.gather(*(one(i, g) for i in range(start, min(n, start + window)) for g in range(len(transfers))))

    async def get_all() -> float:
        buffers = [await t.load_pool.acquire() for t in transfers]
        try:
            t0 = time.perf_counter()
            for start in starts:
                await read(start, buffers)
            return time.perf_counter() - t0
        finally:
            for b in buffers:
                b.release()

    async def scatter_all() -> float:
        spent = 0.0
        for start in starts:
            buffers = [await t.load_pool.acquire() for t in transfers]
            await read(start, buffers)
            t0 = time.perf_counter()
            for g, t in enumerate(transfers):  # each scatter gives its buffer back
                handle = await t.scatter_filled(job.block_ids[g][start : min(n, start + window)], buffers[g])
                await handle.wait()
            spent += time.perf_counter() - t0
        return spent

    async def lookup() -> float:
        t0 = time.perf_counter()
        await client.lookup([k for per in keys for k in per])
        return time.perf_counter() - t0

    row: dict[str, Any] = {
        "blocks": n,
        "bytes": sum(t.block_bytes() for t in transfers) * n,
        "keys": [k for per in keys for k in per],
    }
    for name, fn in (("lookup_s", lookup), ("get_s", get_all), ("scatter_s", scatter_all)):
        row[name] = statistics.median(client.run(fn(), timeout_s=600) for _ in range(repeats))
    return row
