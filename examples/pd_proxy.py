"""A prefill/decode proxy for vLLM instances that hand KV caches over through kvgate: an example, small on purpose.

    python -m examples.pd_proxy --prefill http://p1:8000 --decode http://d1:8000 [--decode http://d2:8000] --port 9000

Each OpenAI completion or chat request (``POST /v1/completions``, ``POST /v1/chat/completions``) goes twice:

1. to a prefill instance (vLLM with ``"kv_role": "kv_producer"``), as is but for ``max_tokens=1``, no streaming and
   ``kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false}``: the prompt's KV cache is
   computed there and stored in kvgate; the answer's ``kv_transfer_params`` name the blocks stored
   (connector/planning/handoff.py: the gateway, the namespace, the block hashes);
2. to a decode instance (``"kv_role": "kv_consumer"``), as the client sent it, with those ``kv_transfer_params``:
   its lookup waits, bounded, for the named blocks still being stored, loads them and decodes. Its answer (streamed
   when the client asked for a stream) is the client's.

Instances of each kind are taken in turn (round robin). When the prefill instance fails (unreachable, an error
status, no ``kv_transfer_params`` in its answer), the request goes to the decode instance without params, and the
decode instance computes the prompt itself: slower, never wrong. When the gateway is slow or down, the decode
instance waits at most its ``handoff_wait_ms`` (and never longer than the cost model predicts recomputing takes),
then recomputes: the proxy does not see it. ``GET /v1/models`` is the first decode instance's; ``GET /healthz``
is the proxy's own.

A request's ``Authorization`` header goes to both instances. The proxy keeps no state between requests.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("kvgate.examples.pd_proxy")

PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
"""What marks a request as the prefill half of a P/D pair (vLLM's disaggregated-serving convention)."""
FORWARDED_HEADERS = ("authorization",)


@dataclass
class Upstreams:
    """The instances of one kind, taken in turn."""

    urls: Sequence[str]
    _turn: Iterator[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("at least one instance is needed")
        self.urls = [u.rstrip("/") for u in self.urls]
        self._turn = itertools.cycle(self.urls)

    def next(self) -> str:
        return next(self._turn)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, no stream, marked for a remote decode."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    """The request as the decode instance gets it: the client's, with the prefill's params when there are any."""
    out = copy.deepcopy(body)
    out.pop("kv_transfer_params", None)
    if params:
        out["kv_transfer_params"] = params
    return out


def create_app(*, prefill: Sequence[str], decode: Sequence[str], timeout_s: float = 600.0) -> FastAPI:
    prefills, decodes = Upstreams(prefill), Upstreams(decode)
    timeout = httpx.Timeout(timeout_s, connect=5.0)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=256)) as client:
            app.state.client = client
            yield

    app = FastAPI(title="kvgate P/D proxy (example)", lifespan=lifespan)
    app.state.counts = {"handoffs": 0, "prefill_failures": 0}

    async def prefill_params(
        client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> Any:
        url = prefills.next()
        try:
            r = await client.post(f"{url}{path}", json=prefill_body(body), headers=headers)
        except httpx.HTTPError as exc:
            log.warning("prefill %s unreachable: %s; the decode instance computes the prompt", url, exc)
            return None
        if r.status_code != 200:
            log.warning("prefill %s answered %d: %s", url, r.status_code, r.text[:200])
            return None
        params = r.json().get("kv_transfer_params")
        if not isinstance(params, dict):
            log.warning("prefill %s named no blocks (is it a kv_producer with kvgate?)", url)
            return None
        return params

    async def handoff(request: Request, path: str) -> Response:
        client: httpx.AsyncClient = request.app.state.client
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return JSONResponse({"error": {"message": "the body is not JSON"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the body is not a JSON object"}}, status_code=400)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        params = await prefill_params(client, path, body, headers)
        counts = request.app.state.counts
        counts["handoffs" if params else "prefill_failures"] += 1
        url = decodes.next()
        upstream = client.build_request("POST", f"{url}{path}", json=decode_body(body, params), headers=headers)
        try:
            r = await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            return JSONResponse({"error": {"message": f"decode instance {url} unreachable: {exc}"}}, status_code=502)
        if not body.get("stream"):
            try:
                content = await r.aread()
            finally:
                await r.aclose()
            return Response(content, status_code=r.status_code, media_type=r.headers.get("content-type"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in r.aiter_raw():
                    yield chunk
            finally:
                await r.aclose()

        return StreamingResponse(relay(), status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handoff(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handoff(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        r = await request.app.state.client.get(f"{decodes.urls[0]}/v1/models")
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/healthz")
    async def healthz(request: Request) -> dict[str, Any]:
        return {"prefill": list(prefills.urls), "decode": list(decodes.urls), **request.app.state.counts}

    return app


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefill", action="append", required=True, help="a prefill instance's URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode instance's URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="an upstream request's longest time")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(create_app(prefill=a.prefill, decode=a.decode, timeout_s=a.timeout_s), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
