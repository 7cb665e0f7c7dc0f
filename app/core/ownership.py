"""Which data directory coordinates a local store root or SQLite index: the processes of one data directory share
each key's lock and the cache epochs through its coordination file (app/core/coordination.py); a process that uses
the same blocks or index through another data directory would share neither with them. So each local resource
keeps a marker naming the coordination file that coordinates it (its path and generation), and a process of another
data directory refuses to start on it while that file is alive.

A marker naming this data directory's path with another generation (the file was recreated) or a coordination file
that is gone is taken over; the processes that held the old file fail closed on their own (``Coordinator.intact``).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from app.core.coordination import GENERATION, CoordinationUnavailable, Coordinator


class ClaimedElsewhere(CoordinationUnavailable):
    """A store root or index is coordinated by another data directory's live coordination file."""


def marker_of(resource: Path) -> Path:
    """The marker of a store root (a dot file in it: listings skip it) or of an index file (a dot file beside it)."""
    return resource / ".kvgate-owner" if resource.is_dir() else resource.with_name(f".{resource.name}.kvgate-owner")


def _alive(path: Path, generation: str) -> bool:
    try:
        with path.open("rb") as f:
            f.seek(GENERATION)
            return f.read(16).hex() == generation
    except OSError:
        return False


def bind(coordinator: Coordinator, resource: Path) -> None:
    """Record that ``coordinator``'s data directory coordinates ``resource``, or raise ``ClaimedElsewhere``."""
    marker = marker_of(resource)
    mine = str(coordinator.path.resolve())
    ours = f"{mine}\n{coordinator.generation.hex()}\n"
    for _ in range(8):
        try:
            found = marker.read_text()
        except FileNotFoundError:
            found = None
        if found == ours:
            return
        if found is not None:
            path, _, generation = found.partition("\n")
            if path != mine and _alive(Path(path), generation.strip()):
                raise ClaimedElsewhere(
                    f"{resource} is used through another data directory (its coordination file is {path}): "
                    "run with that --data-dir, or stop its processes and remove that file"
                )
        tmp = marker.with_name(f"{marker.name}.{os.urandom(6).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, ours.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if found is None:
                with contextlib.suppress(FileExistsError):  # another process bound it first: read it again
                    os.link(tmp, marker)
            else:
                os.replace(tmp, marker)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    raise ClaimedElsewhere(f"{resource}: its owner marker keeps changing")
