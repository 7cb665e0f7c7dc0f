"""An engine step with nothing scheduled waits for the connector's lookups and loads in flight instead of returning
at once (an engine that steps again at once spins, holding the GIL and a core that the lookups and loads need); a
step that has work never waits on the network.

The lookups and loads are held for real: the gateway process is stopped (SIGSTOP) while they are in flight, so they
cannot complete until it is continued. A hook that must not wait is run on a thread and must come back while the
gateway is still stopped (the join's timeout is a safety net that turns a hang into a failure, not a timing check);
a hook that must wait must still be waiting after a second, and come back once the gateway goes on.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from connector.device.transfer import BlockTransfer, KVLayout
from connector.http.client import BlockClient, ClientConfig
from connector.planning.plan import KeyScheme, SchedulerPlanner
from connector.worker.pipeline import WorkerPipeline
from tests.connector.test_pipeline import BLOCK, full_kv, hashes, job, run_naming, shard
from tests.gateway import Gateway

SAFETY_S = 60.0
"""The longest a hook that must not wait may take before the test calls it a hang (a safety net)."""
LONG_WAIT_S = 3600.0
"""The bound given to a hook that must wait: it can only return because what it waits for completed."""


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    gw = Gateway(tmp_path / "data").start()
    yield gw
    if gw.proc is not None and gw.proc.poll() is None:
        os.kill(gw.proc.pid, signal.SIGCONT)
    gw.stop()


@pytest.fixture
def client(gateway: Gateway) -> Iterator[BlockClient]:
    # long timeouts: a lookup or a load held by the stopped gateway stays in flight instead of failing
    cfg = ClientConfig(base_url=gateway.url, request_timeout_s=300, lookup_timeout_s=300, retries=0)
    with BlockClient(cfg) as c:
        yield c


class Stopped:
    """The gateway stopped (SIGSTOP) for the ``with`` block, or until ``resume()``."""

    def __init__(self, gw: Gateway) -> None:
        assert gw.proc is not None
        self.pid = gw.proc.pid

    def __enter__(self) -> Stopped:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def __exit__(self, *exc: object) -> None:
        self.resume()


class Call:
    """``fn()`` on a thread of its own, to see whether it returns while something it may not wait for is held."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as exc:
            self.error = exc

    def returned_within(self, seconds: float) -> bool:
        self._thread.join(timeout=seconds)
        if self.error is not None:
            raise self.error
        return not self._thread.is_alive()


def planner(client: BlockClient) -> SchedulerPlanner:
    nm = run_naming(tp=1, rank=0, dtype=torch.bfloat16)
    return SchedulerPlanner(
        client=client,
        keys=KeyScheme(namings=[nm], num_groups=1),
        block_size=BLOCK,
        hash_block_size=BLOCK,
        lookup_wait_s=LONG_WAIT_S,
    )


def reader(client: BlockClient, *, seed: int) -> tuple[WorkerPipeline, dict[str, torch.Tensor]]:
    kv = shard(full_kv(dtype=torch.bfloat16, seed=seed), tp=1, rank=0)
    transfer = BlockTransfer(kv_caches=kv, layout=KVLayout.NHD, max_blocks_per_batch=4, store_buffers=8, load_buffers=4)
    p = WorkerPipeline(
        client=client, naming=run_naming(tp=1, rank=0, dtype=torch.bfloat16), transfers=[transfer], tp_size=1, tp_rank=0
    )
    return p, kv


def test_a_step_with_work_never_waits_for_a_lookup_and_an_idle_step_does(client: BlockClient, gateway: Gateway) -> None:
    writer, _ = reader(client, seed=1)
    hs = hashes(900, 3)
    writer.store(job("w", hs, [0, 1, 2]))
    writer.wait_uploads(60)
    p = planner(client)

    def matched() -> int | None:
        return p.matched_tokens(req_id="q", block_hashes=list(hs), num_tokens=3 * BLOCK + 5, num_computed_tokens=0)

    with Stopped(gateway) as stopped:
        ask = Call(matched)  # the request's lookup goes out; the gateway cannot answer it
        assert ask.returned_within(SAFETY_S), "the scheduler waited on a lookup in a step that may have work"
        assert ask.result is None  # "ask again"
        busy = Call(lambda: p.build(idle=False))  # a step with work: no wait
        assert busy.returned_within(SAFETY_S), "a step with work waited for a lookup in flight"
        assert busy.result.idle is False
        idle = Call(lambda: p.build(idle=True))  # nothing scheduled: the step waits for the lookup...
        assert not idle.returned_within(1.0), "an idle step returned at once with a lookup in flight"
        stopped.resume()
        assert idle.returned_within(SAFETY_S)  # ...until it completes
    assert idle.result.idle is True
    assert p.lookup_waits == 1
    assert matched() == 3 * BLOCK  # the answer is read at once by the next step


def test_an_idle_step_waits_for_a_load_and_a_step_with_work_does_not(client: BlockClient, gateway: Gateway) -> None:
    writer, src = reader(client, seed=2)
    hs = hashes(901, 6)
    writer.store(job("w", hs, list(range(6))))
    writer.wait_uploads(60)
    p, dest = reader(client, seed=3)
    with Stopped(gateway) as stopped:
        p.start_loads([job("r", hs, list(range(10, 16)))])
        busy = Call(lambda: p.finished_loads(wait_s=0.0))  # get_finished of a step that has work
        assert busy.returned_within(SAFETY_S), "a step with work waited for a load in flight"
        assert busy.result == {}
        idle = Call(lambda: p.finished_loads(wait_s=LONG_WAIT_S))  # nothing scheduled: wait for the load...
        assert not idle.returned_within(1.0), "an idle step returned at once with a load in flight"
        stopped.resume()
        assert idle.returned_within(SAFETY_S)  # ...until it completes, and report it in the same call
    assert idle.result == {"r": set()}
    assert p.stats.load_waits == 1
    for name in src:
        assert torch.equal(dest[name][:, 10:16].view(torch.int16), src[name][:, 0:6].view(torch.int16))
    assert p.finished_loads(wait_s=LONG_WAIT_S) == {}  # nothing in flight: an idle step does not wait
