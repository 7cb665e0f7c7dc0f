"""NamespaceMemo: what a process remembers of namespaces' configs; "no config" only for a while."""

from __future__ import annotations

import asyncio

from app.core.memo import NamespaceMemo


def test_no_config_is_believed_for_retry_s_and_a_value_for_good() -> None:
    believing: NamespaceMemo[int] = NamespaceMemo(retry_s=3600)
    believing.put("ns", None)
    assert believing.known("ns") and believing.get("ns") is None
    doubting: NamespaceMemo[int] = NamespaceMemo(retry_s=0)
    doubting.put("ns", None)
    assert not doubting.known("ns")  # looked up again at its next use
    doubting.put("ns", 4096)
    assert doubting.known("ns") and doubting.get("ns") == 4096  # a config never changes: kept
    doubting.drop("ns")
    assert not doubting.known("ns") and doubting.get("ns") is None


def test_at_most_entries_namespaces_the_oldest_forgotten() -> None:
    memo: NamespaceMemo[str] = NamespaceMemo(entries=2, retry_s=3600)
    memo.put("a", "model-a")
    memo.put("b", None)
    memo.put("b", "model-b")  # known again: not a new entry
    memo.put("c", "model-c")
    assert [memo.known(n) for n in "abc"] == [False, True, True]
    assert memo.get("b") == "model-b"


async def test_a_lookup_is_made_once_for_every_caller_that_needs_it_meanwhile() -> None:
    memo: NamespaceMemo[int] = NamespaceMemo(retry_s=0)  # "no config" is never believed: every use looks
    asked: list[str] = []
    gate = asyncio.Event()

    async def lookup(namespace: str) -> int | None:
        asked.append(namespace)
        await gate.wait()
        return None if namespace == "bare" else 4096

    waiting = [asyncio.ensure_future(memo.fetch(ns, lookup)) for ns in ["ns"] * 16 + ["bare"] * 16]
    await asyncio.sleep(0.01)
    waiting[0].cancel()  # a caller that goes away leaves the lookup to the others
    gate.set()
    got = await asyncio.gather(*waiting[1:])
    assert sorted(asked) == ["bare", "ns"]
    assert got == [4096] * 15 + [None] * 16
    assert await memo.fetch("ns", lookup) == 4096 and len(asked) == 2  # remembered
    assert await memo.fetch("bare", lookup) is None and len(asked) == 3  # "no config": asked again at its next use


async def test_a_failed_lookup_fails_its_callers_and_is_not_remembered() -> None:
    memo: NamespaceMemo[int] = NamespaceMemo(retry_s=3600)
    calls = 0

    async def lookup(namespace: str) -> int | None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        if calls == 1:
            raise RuntimeError("index out")
        return 7

    results = await asyncio.gather(*(memo.fetch("ns", lookup) for _ in range(4)), return_exceptions=True)
    assert calls == 1 and all(isinstance(r, RuntimeError) for r in results)
    assert not memo.known("ns")
    assert await memo.fetch("ns", lookup) == 7 and calls == 2
