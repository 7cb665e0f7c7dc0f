"""The coordination file's identity (app/core/coordination.py): a generation written before the file has its name,
and a process that finds its file removed, replaced or linked elsewhere fails closed, once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.core.coordination import TABLE_BYTES, CoordinationLost, open_coordinator


def test_every_process_opens_one_file_with_one_generation(tmp_path: Path) -> None:
    a, b = open_coordinator(tmp_path), open_coordinator(tmp_path)
    try:
        assert a.generation == b.generation and any(a.generation)
        assert a.intact() and b.intact()
        assert [p.name for p in tmp_path.iterdir()] == ["kvgate.coord"]  # no staging name left behind
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("how", ["removed", "replaced", "linked"])
def test_a_file_removed_replaced_or_linked_fails_closed_once(tmp_path: Path, how: str) -> None:
    calls: list[str] = []
    old = open_coordinator(tmp_path, on_lost=lambda: calls.append("lost"))
    path = tmp_path / "kvgate.coord"
    if how == "linked":
        os.link(path, tmp_path / "copy")
    else:
        path.unlink()
    new = open_coordinator(tmp_path) if how == "replaced" else None
    try:
        assert not old.intact() and not old.intact()
        with pytest.raises(CoordinationLost):
            old.check()
        assert calls == ["lost"]
        if new is not None:
            assert new.intact() and new.generation != old.generation
    finally:
        old.close()
        if new is not None:
            new.close()


def test_a_file_of_an_earlier_release_gets_a_generation_and_keeps_its_epochs(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.coord"
    path.write_bytes(b"\0" * 8 * 5 + (7).to_bytes(8, "little") + b"\0" * (TABLE_BYTES - 48))
    coord = open_coordinator(tmp_path)
    try:
        assert coord.get(5) == 7 and any(coord.generation) and coord.intact()
        again = open_coordinator(tmp_path)
        assert again.generation == coord.generation
        again.close()
    finally:
        coord.close()
