"""NamespaceMemo: what a process remembers of namespaces' configs; "no config" only for a while."""

from __future__ import annotations

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
