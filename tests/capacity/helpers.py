"""Helpers for the capacity tests: the index and the data dir, read behind the gateway's back."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

TEMP_PREFIX = ".kvgate-tmp-"


def index_rows(data_dir: Path) -> dict[str, int]:
    """key -> size of every row in the gateway's SQLite index."""
    with sqlite3.connect(data_dir / "index.db") as conn:
        return {k: int(s) for k, s in conn.execute("SELECT key, size FROM blocks")}


def block_files(data_dir: Path) -> dict[str, int]:
    """key -> size of every published block file (temp files, configs and part data excluded)."""
    root = data_dir / "blocks"
    found: dict[str, int] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            if not name.endswith(".bin") or name.startswith("."):
                continue
            full = Path(dirpath) / name
            rel = full.relative_to(root).as_posix()
            if not rel.startswith("_parts/"):
                found[rel] = full.stat().st_size
    return found


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page: (name, sorted labels) -> value."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
