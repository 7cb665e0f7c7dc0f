"""app/api/errors.py is the ONE error table: every error type the domain and the contract raise is in it, and a
route that lets one escape gets the table's answer (no translation by hand in app/api)."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType

import pytest

import app.errors
import contract.keys
import contract.wire
from app.api.errors import ERROR_TABLE, lookup
from tests.conftest import TEST_NS, key_for, random_bytes
from tests.unit.inprocess import running, settings_for

BASES = {app.errors.KVGateError}
"""Abstract bases: never raised themselves."""


def _error_types(module: ModuleType) -> list[type[Exception]]:
    return [
        obj
        for _name, obj in inspect.getmembers(module, inspect.isclass)
        if issubclass(obj, Exception) and obj not in BASES and obj.__module__ == module.__name__
    ]


@pytest.mark.parametrize("module", [app.errors, contract.keys, contract.wire], ids=lambda m: m.__name__)
def test_every_error_type_is_in_the_table(module: ModuleType) -> None:
    types = _error_types(module)
    assert types
    unmapped = [t.__name__ for t in types if not any(k in ERROR_TABLE for k in t.__mro__)]
    assert unmapped == []


def test_one_class_per_condition() -> None:
    """A range that selects nothing is one class, whoever raises it (the gateway's core or the wire grammar)."""
    assert app.errors.RangeNotSatisfiable is contract.wire.RangeNotSatisfiable
    assert lookup(contract.wire.RangeNotSatisfiable("x", size=3)) == (416, "range_not_satisfiable")
    assert lookup(contract.keys.InvalidKey("x")) == (400, "invalid_request")
    assert lookup(contract.wire.MalformedHeader("x")) == (400, "invalid_request")


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
