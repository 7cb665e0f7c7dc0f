"""POST /v1/lookup in process: the answer's bytes are LookupResponse's own JSON; bad keys and too many keys."""

from __future__ import annotations

from app.api.routes.lookup import LookupResponse, LookupSlot
from tests.conftest import crc, key_for, random_bytes
from tests.inprocess.harness import InProcessGateway


async def test_answer_is_the_models_json(gw: InProcessGateway) -> None:
    c = gw.client
    bodies = {i: random_bytes(1000 + i, i) for i in (0, 1, 2, 4)}
    for i, data in bodies.items():
        assert (await c.put(f"/v1/blocks/{key_for(i)}", content=data)).status_code == 201
    keys = [key_for(i) for i in range(6)]
    r = await c.post("/v1/lookup", json={"keys": keys})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    slots = [
        LookupSlot(key=k, present=True, size=len(bodies[i]), etag=f'"{crc(bodies[i])}"')
        if i in bodies
        else LookupSlot(key=k, present=False)
        for i, k in enumerate(keys)
    ]
    assert r.content == LookupResponse(prefix=3, blocks=slots).model_dump_json().encode()
    empty = await c.post("/v1/lookup", json={"keys": []})
    assert empty.status_code == 200 and empty.json() == {"prefix": 0, "blocks": []}


async def test_bad_key_is_400_and_too_many_keys_413(gw: InProcessGateway) -> None:
    c = gw.client
    bad = await c.post("/v1/lookup", json={"keys": [key_for(0), "ns_0123456789ab_r0/abc/de_g0/ABCDEF0123456789.bin"]})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    shape = await c.post("/v1/lookup", json={"keys": "not a list"})
    assert shape.status_code == 422
    limit = gw.app.state.settings.max_lookup_keys
    many = await c.post("/v1/lookup", json={"keys": [key_for(i) for i in range(limit + 1)]})
    assert many.status_code == 413
