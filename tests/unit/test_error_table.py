"""app/api/errors.py is the ONE error table: every error type the domain and the contract raise is in it, and a
route that lets one escape gets the table's answer (no translation by hand in app/api; the route half is in
tests/inprocess/test_error_table.py)."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

import app.errors
import contract.keys
import contract.wire
from app.api.errors import ERROR_TABLE, lookup

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
