"""A route that lets a domain or contract error escape gets app/api/errors.py's table's answer, in process (the
table's completeness is checked without an app in tests/unit/test_error_table.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import TEST_NS, key_for, random_bytes
from tests.inprocess.harness import running, settings_for


async def test_contract_errors_reach_clients_as_the_table_says(tmp_path: Path) -> None:
    data = random_bytes(1000, 3)
    async with running(settings_for(tmp_path)) as gw:
        c = gw.client
        assert (await c.put(f"/v1/blocks/{key_for(1)}", content=data)).status_code == 201
        answers = {
            "namespace": await c.get("/v1/namespaces/not_a_namespace"),
            "digest": await c.put(f"/v1/blocks/{key_for(2)}", content=data, headers={"X-KVGate-SHA256": "zz"}),
            "part digest": await c.put(
                f"/v1/blocks/{key_for(2)}",
                content=data,
                headers={"Content-Range": "bytes 0-999/2000", "X-KVGate-Part-SHA256": "zz"},
            ),
            "content-range": await c.put(
                f"/v1/blocks/{key_for(2)}", content=data, headers={"Content-Range": "bytes 0-x/2000"}
            ),
            "range": await c.get(f"/v1/blocks/{key_for(1)}", headers={"Range": "bytes=1-2,4-5"}),
        }
        for what, r in answers.items():
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_request"), what
        past = await c.put(f"/v1/blocks/{key_for(2)}", content=data, headers={"Content-Range": "bytes 0-999/999"})
        assert past.status_code == 416 and past.headers["Content-Range"] == "bytes */999"
        beyond = await c.get(f"/v1/blocks/{key_for(1)}", headers={"Range": "bytes=5000-"})
        assert beyond.status_code == 416 and beyond.headers["Content-Range"] == "bytes */1000"
        assert (await c.get(f"/v1/namespaces/{TEST_NS}")).status_code == 200
