"""One stream for a deployment, whoever commits: two gateway processes on one data directory (SQLite) and ``kvgate gc``
beside them; two replicas over PostgreSQL and SeaweedFS. Each committed change is published once, the numbers are
dense, any process serves the whole stream, and when the publisher dies another takes over where it stopped.

Before the event log each process published only its own commits (gc and import nothing), the second process could
not bind the PUB port, and each numbered from its own clock."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from app.core.memo import NAMESPACE_RETRY_S
from app.events.wire import Topics
from contract.keys import namespace_for
from tests.conftest import agnostic_fields, key_for
from tests.events.helpers import (
    ZmqTap,
    events_env,
    events_gateway,
    hello,
    joined,
    read_batches,
    run_gc,
    run_tool,
    wait_for_publisher,
)
from tests.events.router import END
from tests.gateway import Gateway, free_port
from tests.services import SeaweedServer, unique_bucket


def _stream(url: str, *, since: int, events: int) -> list[tuple[int, str, str]]:
    """(seq, type, key) of each event from ``since`` on, checking the numbers are dense."""
    batches = read_batches(url, since=since, events=events)
    seqs = [b["seq"] for b in batches]
    assert seqs == list(range(since, since + len(seqs))), seqs
    return [(b["seq"], e["type"], e["key"]) for b in batches for e in b["events"]]


def _replay(endpoint: str, start: int) -> list[int]:
    """The sequence numbers the replay socket at ``endpoint`` answers from ``start`` with."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while sock.poll(10_000):
            _empty, _topic, seq, _payload = sock.recv_multipart()
            if seq == END:
                return out
            out.append(int.from_bytes(seq, "big"))
        raise AssertionError(f"no end marker after {out}")
    finally:
        sock.close(linger=0)
        ctx.term()


def _put(url: str, keys: list[str], fill: bytes) -> None:
    with httpx.Client(base_url=url, timeout=30) as http:
        for key in keys:
            assert http.put(f"/v1/blocks/{key}", content=fill * 64).status_code == 201


def test_two_processes_gc_and_import_one_stream_and_a_takeover(tmp_path: Path) -> None:
    data = tmp_path / "data"
    ports = (free_port(), free_port())
    env = {"KVGATE_META_CACHE_TTL_S": "0"}
    a = events_gateway(data, env=env, ports=ports).start()
    b = events_gateway(data, env=env, ports=ports).start()
    tap = ZmqTap(a.pub)  # type: ignore[attr-defined]
    try:
        assert a.proc is not None and b.proc is not None
        leader = wait_for_publisher(ports[0], [a.proc.pid, b.proc.pid])
        start = joined(a.url, tap)
        _put(a.url, [key_for(i) for i in range(10)], b"a")
        _put(b.url, [key_for(i) for i in range(10, 20)], b"b")
        (data / "blocks" / key_for(3)).unlink()  # behind the gateways' back: gc drops its row
        assert run_gc(data, env=events_env(*ports))["rows_dropped"] == 1
        source = tmp_path / "fs-tier"  # a vLLM fs-tier directory, imported (copied in)
        for i in (30, 31):
            (source / key_for(i)).parent.mkdir(parents=True, exist_ok=True)
            (source / key_for(i)).write_bytes(bytes([i]) * 100)
        assert run_tool("import", str(source), data_dir=data, env=events_env(*ports))["blocks"] == 2
        expected = [("BlockStored", key_for(i)) for i in range(20)] + [("BlockRemoved", key_for(3))]
        events = _stream(a.url, since=start, events=23)
        assert [(t, k) for _s, t, k in events[:21]] == expected  # once each, in commit order, gc's included
        assert sorted((t, k) for _s, t, k in events[21:]) == [("BlockStored", key_for(i)) for i in (30, 31)]
        assert _stream(b.url, since=start, events=23) == events  # the process not publishing serves the same
        tap.wait(lambda t: t.batches[-1][1] == events[-1][0])
        live = [seq for _topic, seq, _b in tap.batches if seq >= start]
        assert live == sorted(set(live)) == list(range(start, events[-1][0] + 1))  # one publisher, each batch once

        dead, survivor = (a, b) if leader == a.proc.pid else (b, a)
        assert survivor.proc is not None
        dead.kill9()
        assert wait_for_publisher(ports[0], [survivor.proc.pid]) == survivor.proc.pid  # it took over the ports
        _put(survivor.url, [key_for(i) for i in range(20, 25)], b"c")
        after = _stream(survivor.url, since=start, events=28)
        assert after[:23] == events  # nothing lost, nothing renumbered
        assert [(t, k) for _s, t, k in after[23:]] == [("BlockStored", key_for(i)) for i in range(20, 25)]
        assert after[23][0] == events[-1][0] + 1  # no jump
        assert _replay(survivor.replay, start) == list(range(start, after[-1][0] + 1))  # type: ignore[attr-defined]
    finally:
        tap.close()
        a.stop()
        b.stop()


def test_workers_publish_one_stream_and_another_takes_over(tmp_path: Path) -> None:
    """``kvgate serve --workers 2`` with events on (refused before the event log): writers on many connections (spread
    over both workers) make one stream, each change once; the publishing worker killed, another takes over the ports
    (the survivor, or the supervisor's replacement) and the numbers go on."""
    ports = (free_port(), free_port())
    gw = Gateway(tmp_path / "data", workers=2, env={**events_env(*ports), "KVGATE_META_CACHE_TTL_S": "0"}).start()
    tap = ZmqTap(f"tcp://127.0.0.1:{ports[0]}")
    try:
        leader = wait_for_publisher(ports[0], gw.worker_pids())
        start = joined(gw.url, tap)

        async def writers(first: int, count: int) -> None:
            async def one(i: int) -> None:
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:  # a connection each
                    assert (await http.put(f"/v1/blocks/{key_for(i)}", content=b"w" * 64)).status_code == 201

            await asyncio.gather(*(one(i) for i in range(first, first + count)))

        asyncio.run(writers(0, 40))
        events = _stream(gw.url, since=start, events=40)
        assert sorted(k for _s, _t, k in events) == sorted(key_for(i) for i in range(40))  # once each
        tap.wait(lambda t: t.batches[-1][1] == events[-1][0])
        live = [seq for _topic, seq, _b in tap.batches if seq >= start]
        assert live == list(range(start, events[-1][0] + 1))  # one publisher: each batch once, in order

        gw.kill9_worker(leader)
        assert wait_for_publisher(ports[0], [p for p in gw.worker_pids() if p != leader]) != leader
        asyncio.run(writers(40, 10))
        after = _stream(gw.url, since=start, events=50)
        assert after[:40] == events and after[40][0] == events[-1][0] + 1  # nothing lost, no jump
        assert sorted(k for _s, _t, k in after[40:]) == sorted(key_for(i) for i in range(40, 50))
    finally:
        tap.close()
        gw.stop()


def _replicas(root: Path, env: dict[str, str]) -> list[Gateway]:
    gateways = [events_gateway(root / name, env=env) for name in ("a", "b")]  # each its own ports, as on two hosts
    with ThreadPoolExecutor(2) as pool:
        for started in [pool.submit(g.start) for g in gateways]:
            started.result()
    return gateways


def test_replicas_publish_each_change_once(tmp_path: Path, seaweedfs_server: SeaweedServer, pg_db: str) -> None:
    """Two replicas over one PostgreSQL index and one SeaweedFS bucket, each configured with its own ZMQ addresses: a
    subscriber connected to both gets every change once, numbered densely, whichever replica took the write; when
    the publishing replica dies, the other publishes on its own addresses and the numbers go on."""
    env = {**seaweedfs_server.backend_env(bucket=unique_bucket(), prefix="kv"), "KVGATE_DB_URL": pg_db}
    a, b = _replicas(tmp_path, env)
    taps: list[ZmqTap] = []
    try:
        leader = _publisher_of([a, b])
        follower = b if leader is a else a
        assert not _publishes(follower)  # one at a time
        taps = [ZmqTap(a.pub), ZmqTap(b.pub)]  # type: ignore[attr-defined]
        merged = _Merged(taps)
        start = joined(leader.url, taps[0] if leader is a else taps[1])
        _put(a.url, [key_for(i) for i in range(10)], b"a")
        _put(b.url, [key_for(i) for i in range(10, 20)], b"b")
        with httpx.Client(base_url=follower.url, timeout=30) as http:
            assert http.delete(f"/v1/blocks/{key_for(0)}").status_code == 204
        expected = [("BlockStored", key_for(i)) for i in range(20)] + [("BlockRemoved", key_for(0))]
        events = _stream(follower.url, since=start, events=21)
        assert sorted((t, k) for _s, t, k in events) == sorted(expected)  # once each
        assert _stream(leader.url, since=start, events=21) == events
        merged.wait_through(events[-1][0])
        assert merged.seqs(start) == list(range(start, events[-1][0] + 1))  # each batch once, from one replica

        leader.kill9()
        assert follower.proc is not None
        assert wait_for_publisher(follower.ports[0], [follower.proc.pid]) == follower.proc.pid  # type: ignore[attr-defined]
        _put(follower.url, [key_for(i) for i in range(20, 25)], b"c")
        after = _stream(follower.url, since=start, events=26)
        assert after[:21] == events and after[21][0] == events[-1][0] + 1  # nothing lost, no jump
        assert [(t, k) for _s, t, k in after[21:]] == [("BlockStored", key_for(i)) for i in range(20, 25)]
        assert _replay(follower.replay, start) == list(range(start, after[-1][0] + 1))  # type: ignore[attr-defined]
    finally:
        for tap in taps:
            tap.close()
        a.stop()
        b.stop()


def _publisher_of(gateways: list[Gateway], *, timeout_s: float = 60.0) -> Gateway:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for gw in gateways:
            if _publishes(gw):
                return gw
        time.sleep(0.1)
    raise AssertionError("no replica publishes")


def _publishes(gw: Gateway) -> bool:
    from tests.events.helpers import listening_pid

    assert gw.proc is not None
    return listening_pid(gw.ports[0], [gw.proc.pid]) is not None  # type: ignore[attr-defined]


class _Merged:
    """The batches of several PUB endpoints, as one subscriber connected to all of them sees them."""

    def __init__(self, taps: list[ZmqTap]) -> None:
        self.taps = taps

    def batches(self) -> list[tuple[str, int, Any]]:
        return [b for tap in self.taps for b in tap.batches]

    def seqs(self, start: int) -> list[int]:
        return sorted(seq for _t, seq, _b in self.batches() if seq >= start)

    def wait_through(self, seq: int) -> None:
        self.taps[0].wait(lambda _t: any(s >= seq for _x, s, _b in self.batches()))


def test_a_config_stored_in_another_process_names_the_model_in_later_topics(tmp_path: Path) -> None:
    """A namespace whose blocks came before its config (a TP>1 engine's other ranks store while rank 0's config PUT
    is in flight) goes out under its own name; once its config is stored, in a process that does not publish, its
    next events go out under the model's topic. Before, the publisher kept "no config" for good, and every later
    event of that model went under the namespace's name, a topic no router keyed by model follows."""
    data = tmp_path / "data"
    ports = (free_port(), free_port())
    a = events_gateway(data, ports=ports).start()
    b = events_gateway(data, ports=ports).start()
    ns = namespace_for(agnostic_fields("org-c/model-c"))
    try:
        assert a.proc is not None and b.proc is not None
        other = b if wait_for_publisher(ports[0], [a.proc.pid, b.proc.pid]) == a.proc.pid else a
        start = hello(other.url)["next_seq"]
        _put(other.url, [key_for(1, namespace=ns)], b"x")
        (before,) = read_batches(other.url, since=start, events=1)
        assert before["topic"] == Topics().render(namespace=ns, model=None)  # no config: the namespace's model part
        fields = agnostic_fields("org-c/model-c")
        assert httpx.put(f"{other.url}/v1/namespaces/{ns}/config", json=fields, timeout=30).status_code == 201
        time.sleep(NAMESPACE_RETRY_S + 0.1)  # a namespace without a config is looked up again after this long
        _put(other.url, [key_for(2, namespace=ns)], b"y")
        after = read_batches(other.url, since=start, events=2)
        assert [e["key"] for batch in after for e in batch["events"]] == [key_for(i, namespace=ns) for i in (1, 2)]
        assert after[-1]["topic"] == "kv@pool:kvgate@org-c/model-c"
    finally:
        a.stop()
        b.stop()
