"""The benchmarks and loopback/ (the servers they share with the tests) stand on their own: neither imports tests/,
so a benchmark runs without the test suite's fixtures and a test helper can change without breaking one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted(p for top in ("benchmarks", "loopback") for p in (REPO / top).rglob("*.py"))


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_nothing_from_tests(path: Path) -> None:
    reaching = sorted(n for n in _imported(path) if n == "tests" or n.startswith("tests."))
    assert not reaching, f"{path.relative_to(REPO)} imports {reaching}"
