"""The P/D proxy example (examples/pd_proxy.py) on loopback: what it sends to a prefill and a decode instance, what
it answers, and what it does when the prefill instance fails.

The instances here are stand-ins that record what they get and answer as vLLM's OpenAI server does (its JSON, its
server-sent events, ``kv_transfer_params`` in a prefill's answer): the wire contract with the proxy. The proxy in
front of two real ``vllm serve`` instances, a producer and a consumer, is ``benchmarks/engine/pd_proxy.py``."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from examples.pd_proxy import PREFILL_PARAMS, create_app
from tests.gateway import free_port

HANDOFF = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "kvgate_num_blocks": 2,
    "kvgate_block_hashes": ["ab", "cd"],
}
CHUNKS = [b'data: {"choices":[{"text":"one"}]}\n\n', b'data: {"choices":[{"text":" two"}]}\n\n', b"data: [DONE]\n\n"]


@dataclass
class Instance:
    """A stand-in for one vLLM OpenAI server: records each request; answers as ``status`` says."""

    name: str
    status: int = 200
    got: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def answer(request: Request) -> Response:
            body = await request.json()
            self.got.append({"path": request.url.path, "body": body, "auth": request.headers.get("authorization")})
            if self.status != 200:
                return JSONResponse({"error": {"message": f"{self.name} says no"}}, status_code=self.status)
            if body.get("stream"):

                async def events() -> Any:
                    for chunk in CHUNKS:
                        yield chunk
                        await asyncio.sleep(0.01)

                return StreamingResponse(events(), media_type="text/event-stream")
            params = HANDOFF | {"from": self.name} if body.get("kv_transfer_params") == PREFILL_PARAMS else None
            return JSONResponse(
                {"id": self.name, "choices": [{"text": f"by {self.name}"}], "kv_transfer_params": params}
            )

        app.add_api_route("/v1/completions", answer, methods=["POST"])
        app.add_api_route("/v1/chat/completions", answer, methods=["POST"])
        app.add_api_route("/v1/models", lambda: {"data": [{"id": self.name}]}, methods=["GET"])
        return app


class Serving:
    """ASGI apps served by uvicorn on loopback ports, each in a thread of its own."""

    def __init__(self) -> None:
        self.servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(self, app: FastAPI) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        self.servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(10)


@pytest.fixture
def serving() -> Iterator[Serving]:
    s = Serving()
    yield s
    s.stop()


def proxy_of(serving: Serving, prefill: list[Instance | str], decode: list[Instance]) -> str:
    p_urls = [p if isinstance(p, str) else serving.start(p.app()) for p in prefill]
    d_urls = [serving.start(d.app()) for d in decode]
    return serving.start(create_app(prefill=p_urls, decode=d_urls, timeout_s=10))


def test_a_completion_is_prefilled_then_decoded_with_the_prefills_params(serving: Serving) -> None:
    p, d = Instance("p"), Instance("d")
    url = proxy_of(serving, [p], [d])
    ask = {"model": "m", "prompt": "hello there", "max_tokens": 7, "temperature": 0, "logprobs": 2}
    r = httpx.post(f"{url}/v1/completions", json=ask, headers={"Authorization": "Bearer t"})
    assert r.status_code == 200 and r.json()["choices"] == [{"text": "by d"}]
    (sent_p,), (sent_d,) = p.got, d.got
    assert sent_p["body"] == ask | {"max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_PARAMS}
    assert sent_d["body"] == ask | {"kv_transfer_params": HANDOFF | {"from": "p"}}
    assert sent_p["auth"] == sent_d["auth"] == "Bearer t"
    assert httpx.get(f"{url}/healthz").json() | {"prefill": 0, "decode": 0} == {
        "prefill": 0,
        "decode": 0,
        "handoffs": 1,
        "prefill_failures": 0,
    }


def test_a_streamed_chat_streams_the_decode_instances_events_byte_for_byte(serving: Serving) -> None:
    p, d = Instance("p"), Instance("d")
    url = proxy_of(serving, [p], [d])
    ask = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=ask) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert b"".join(r.iter_raw()) == b"".join(CHUNKS)
    (sent_p,), (sent_d,) = p.got, d.got
    assert sent_p["path"] == sent_d["path"] == "/v1/chat/completions"
    want_p = {k: v for k, v in ask.items() if k != "stream_options"}
    assert sent_p["body"] == want_p | {
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    assert sent_d["body"] == ask | {"kv_transfer_params": HANDOFF | {"from": "p"}}


def test_instances_of_each_kind_take_turns(serving: Serving) -> None:
    ps, ds = [Instance("p0"), Instance("p1")], [Instance("d0"), Instance("d1"), Instance("d2")]
    url = proxy_of(serving, ps, ds)
    for i in range(6):
        assert httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": f"n{i}"}).status_code == 200
    assert [len(p.got) for p in ps] == [3, 3] and [len(d.got) for d in ds] == [2, 2, 2]
    # each decode request carries the params of the prefill that ran for the same prompt
    for d in ds:
        for got in d.got:
            assert got["body"]["kv_transfer_params"]["from"] in ("p0", "p1")
    assert httpx.get(f"{url}/v1/models").json() == {"data": [{"id": "d0"}]}


@pytest.mark.parametrize("how", ["down", "error"])
def test_a_failed_prefill_leaves_the_prompt_to_the_decode_instance(serving: Serving, how: str) -> None:
    d = Instance("d")
    prefill: Instance | str = f"http://127.0.0.1:{free_port()}" if how == "down" else Instance("p", status=500)
    url = proxy_of(serving, [prefill], [d])
    ask = {"model": "m", "prompt": "hello", "max_tokens": 3}
    r = httpx.post(f"{url}/v1/completions", json=ask)
    assert r.status_code == 200 and r.json()["id"] == "d"
    assert [g["body"] for g in d.got] == [ask]  # no params: the decode instance computes the prompt
    assert httpx.get(f"{url}/healthz").json()["prefill_failures"] == 1


def test_the_decode_instances_error_reaches_the_client_as_it_was(serving: Serving) -> None:
    p, d = Instance("p"), Instance("d", status=400)
    url = proxy_of(serving, [p], [d])
    r = httpx.post(f"{url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert r.status_code == 400 and r.json() == {"error": {"message": "d says no"}}


def test_a_body_that_is_not_a_json_object_is_a_400_and_reaches_no_instance(serving: Serving) -> None:
    p, d = Instance("p"), Instance("d")
    url = proxy_of(serving, [p], [d])
    for content in (b"not json", json.dumps([1, 2]).encode()):
        r = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    assert p.got == [] and d.got == []
