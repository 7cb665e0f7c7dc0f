"""GET /v1/events and ``kvgate events`` against a running gateway: what committed, in commit order, nothing else."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from pathlib import Path

import httpx
from typer.testing import CliRunner

from app.tools.cli import cli
from contract.keys import namespace_for
from tests.conftest import TEST_NS, agnostic_fields, crc, key_for
from tests.events.helpers import events_gateway, hello, read_batches, sse
from tests.gateway import Gateway

OTHER_NS = namespace_for(agnostic_fields("other-org/other-model"))


def test_sse_stream_and_cli_tail(tmp_path: Path) -> None:
    gw = events_gateway(tmp_path / "data").start()
    try:
        first = hello(gw.url)["next_seq"]
        a, b, o = key_for(1), key_for(2), key_for(3, namespace=OTHER_NS)
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            meta = {"X-KVGate-Block-Meta": "tokens=7,8,9"}
            assert http.put(f"/v1/blocks/{a}", content=b"a" * 100, headers=meta).status_code == 201
            assert http.put(f"/v1/blocks/{o}", content=b"o" * 100).status_code == 201
            # writes that do not commit publish nothing
            bad = {"X-KVGate-SHA256": "0" * 64}
            assert http.put(f"/v1/blocks/{b}", content=b"b" * 100, headers=bad).status_code == 400
            assert http.put(f"/v1/blocks/{a}", content=b"z", headers={"If-None-Match": "*"}).status_code == 412
            assert (
                http.put(f"/v1/blocks/{b}", content=b"b", headers={"X-KVGate-Block-Meta": "tokens=x"}).status_code
                == 400
            )
            assert http.delete(f"/v1/blocks/{b}").status_code == 404
            assert http.put(f"/v1/blocks/{b}", content=b"b" * 50).status_code == 201
            assert http.delete(f"/v1/blocks/{a}").status_code == 204
            assert http.delete(f"/v1/namespaces/{OTHER_NS}").status_code == 200
        batches = read_batches(gw.url, since=first, events=5)
        events = [e for batch in batches for e in batch["events"]]
        # each topic's (here: namespace's) events in commit order; a round of the publisher that reads several
        # topics' rows sends one batch per topic, so across topics the order is commit order only between rounds
        assert [(e["type"], e["key"]) for e in events if e["namespace"] == TEST_NS] == [
            ("BlockStored", a),
            ("BlockStored", b),
            ("BlockRemoved", a),
        ]
        assert [(e["type"], e["key"]) for e in events if e["namespace"] == OTHER_NS] == [
            ("BlockStored", o),
            ("BlockRemoved", o),
        ]
        assert len(events) == 5 and all(len({e["namespace"] for e in b["events"]}) == 1 for b in batches)
        stored_a = events[0]  # the first row of the first round: its topic's batch comes first
        assert stored_a["key"] == a and stored_a["type"] == "BlockStored"
        assert stored_a["token_ids"] == [7, 8, 9] and stored_a["parent_block_hash"] is None
        assert stored_a["digest"] == crc(b"a" * 100) and stored_a["size"] == 100
        assert [b["seq"] for b in batches] == list(range(first, first + len(batches)))

        only = read_batches(gw.url, since=first, events=3, namespace=TEST_NS)
        assert [(e["type"], e["key"]) for b in only for e in b["events"]] == [
            ("BlockStored", a),
            ("BlockStored", b),
            ("BlockRemoved", a),
        ]

        runner = CliRunner()
        out = runner.invoke(cli, ["events", "--url", gw.url, "--since", str(first), "--count", str(len(batches))])
        assert out.exit_code == 0, out.output
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert lines == batches
    finally:
        gw.stop()


def test_events_off_by_default(gateway: Gateway) -> None:
    resp = httpx.get(f"{gateway.url}/v1/events", timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "events_disabled"


def test_concurrent_writers_events_complete_and_in_commit_order(tmp_path: Path) -> None:
    """16 writers PUT and DELETE 12 shared keys at random: replaying the events in order gives exactly the store's
    final state (each key's last event is its last committed change), and every acknowledged change has its event."""
    gw = events_gateway(tmp_path / "data").start()
    keys = [key_for(i) for i in range(12)]
    acked = {"put": 0, "delete": 0}
    try:
        first = hello(gw.url)["next_seq"]

        async def writer(w: int) -> None:
            rnd = random.Random(w)
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as http:
                for n in range(40):
                    key = rnd.choice(keys)
                    if rnd.random() < 0.3:
                        if (await http.delete(f"/v1/blocks/{key}")).status_code == 204:
                            acked["delete"] += 1
                    else:
                        resp = await http.put(f"/v1/blocks/{key}", content=f"{w}:{n}".encode() * 64)
                        assert resp.status_code in (200, 201), resp.text
                        acked["put"] += 1

        async def run() -> None:
            await asyncio.gather(*(writer(w) for w in range(16)))

        asyncio.run(run())
        total = acked["put"] + acked["delete"]
        batches = read_batches(gw.url, since=first, events=total)
        events = [e for b in batches for e in b["events"]]
        assert len(events) == total  # every PUT wrote new bytes, every 204 removed a row: one event each
        assert sum(e["type"] == "BlockStored" for e in events) == acked["put"]
        state: dict[str, str] = {}
        for e in events:
            if e["type"] == "BlockStored":
                state[e["key"]] = e["digest"]
            else:
                assert state.pop(e["key"], None) is not None  # a removal follows a store of that key
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            for key in keys:
                resp = http.head(f"/v1/blocks/{key}")
                if key in state:
                    assert resp.status_code == 200 and resp.headers["etag"] == f'"{state[key]}"'
                else:
                    assert resp.status_code == 404
    finally:
        gw.stop()


def test_restart_sequence_goes_on_without_a_jump_and_replays_across_it(tmp_path: Path) -> None:
    """Numbers are persisted with the batches: after a restart the next batch is the next number (no jump, no
    reuse), and a stream asking from before the restart gets what the previous process sent, then the new ones.
    Before the event log the restarted process numbered from the clock (a jump) and held nothing from before it."""
    gw = events_gateway(tmp_path / "data").start()
    try:
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert http.put(f"/v1/blocks/{key_for(1)}", content=b"x" * 10).status_code == 201
        first = hello(gw.url)["first_seq"]
        before = read_batches(gw.url, since=first, events=1)[-1]["seq"]
        assert first == before == 0  # a new stream's first batch is 0, as a vLLM engine's (Dynamo expects it)
        gw.restart()
        after = hello(gw.url)
        assert after["next_seq"] == before + 1 and after["first_seq"] == first
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            assert http.put(f"/v1/blocks/{key_for(2)}", content=b"y" * 10).status_code == 201
        batches = read_batches(gw.url, since=first, events=2)  # a gap would fail it (only hello and batch allowed)
        assert [b["seq"] for b in batches] == [before, before + 1]
        assert [e["key"] for b in batches for e in b["events"]] == [key_for(1), key_for(2)]
    finally:
        gw.stop()


def test_numbers_no_longer_kept_are_a_gap(tmp_path: Path) -> None:
    """The index keeps the newest KVGATE_EVENTS_BUFFER batches (the log is trimmed with them): a stream from an
    older number says gap, then goes on with the oldest kept."""
    gw = events_gateway(tmp_path / "data", env={"KVGATE_EVENTS_BUFFER": "5"}).start()
    try:
        start = hello(gw.url)["next_seq"]
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            # one at a time, past the bound many times: trimmed on the way (every few dozen publisher rounds; a
            # round takes what committed since the last, so how many PUTs make a round depends on their speed)
            for i in range(5000):
                assert http.put(f"/v1/blocks/{key_for(i)}", content=b"z" * 10).status_code == 201
                if i % 50 == 49 and hello(gw.url)["first_seq"] > start:
                    break
        first = hello(gw.url)["first_seq"]
        assert start < first
        with httpx.stream("GET", f"{gw.url}/v1/events", params={"since": start}, timeout=30) as resp:
            stream = sse(resp)
            assert next(stream)[0] == "hello"
            event, data = next(stream)
            assert event == "gap" and data["next_seq"] == first
            event, data = next(stream)
            assert event == "batch" and data["seq"] == first
    finally:
        gw.stop()


def test_open_stream_ends_when_the_gateway_stops(tmp_path: Path) -> None:
    """uvicorn waits for open responses before it stops: SIGTERM ends the event streams (``event: closed``)."""
    gw = events_gateway(tmp_path / "data").start()
    try:
        with httpx.stream("GET", f"{gw.url}/v1/events", timeout=30) as resp:
            stream = sse(resp)
            assert next(stream)[0] == "hello"
            assert gw.proc is not None
            gw.proc.terminate()
            assert next(stream)[0] == "closed"
        # it stops by itself (uvicorn re-raises the SIGTERM it caught once it has shut down), no kill -9 needed
        assert gw.proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        gw.stop()
