"""Reconcile the index with the store: at start-up (before serving) and from ``kvgate gc``.

- temp files of interrupted writes are removed (filesystem store);
- a row whose data is gone is dropped; a row whose data is another version than the one it names (found by a
  stat, not by re-hashing the store) is settled by which is older. Data older than its row is the version before
  it (a crash between the row and the rename): re-read and recorded. Data newer than its row was changed behind
  the gateway's back: kept if its bytes are still the row's (a copy, a touch), else removed with its row as
  corruption (a miss, never bytes the row does not vouch for; BlockService.repair);
- S3 versions that no row names (a write that never committed, a replaced version) are removed once older than
  ``stale_parts_s``;
- data without a row is adopted: size and digest recomputed (bounded concurrency), namespace/rank/group parsed
  from the key with contract.keys.parse_block_key; created/last access = the object's mtime, 0 hits;
- keys that are not block keys: ``<ns>/config.json`` is adopted into the namespaces table if its fields hash to
  the name; anything else is left alone and logged;
- incomplete multi-part uploads (``_parts/``) older than ``stale_parts_s`` are dropped (data, then rows), and so
  is part data that no row describes: a writer that died mid-upload leaks nothing for longer than that.

DB work is batched: one scan of (key, size), one chunked DELETE, chunked executemany upserts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.core.parts import PARTS_PREFIX
from app.core.service import BlockService
from app.errors import BlockNotFound
from app.index import BlockRecord, Index
from app.storage import BlockStore, ObjectInfo
from contract.keys import InvalidKey, check_namespace_fields, parse_block_key, parse_config_key

log = logging.getLogger("kvgate.reconcile")

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total): phases 'scan', 'digest', 'write'."""


@dataclass(slots=True)
class ReconcileReport:
    rows_dropped: int = 0
    adopted: int = 0
    resized: int = 0
    configs_adopted: int = 0
    temp_removed: int = 0
    stale_uploads_dropped: int = 0
    part_objects_removed: int = 0
    part_dirs_removed: int = 0
    stale_versions_removed: int = 0
    corrupt_removed: int = 0
    left_alone: list[str] = field(default_factory=list)
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0


async def _read_small(store: BlockStore, key: str, *, limit: int = 1 << 20) -> bytes | None:
    async with await store.open(key) as reader:
        if reader.size > limit:
            return None
        return b"".join([c async for c in reader.chunks(start=0, end=reader.size)])


async def _adopt_config(store: BlockStore, index: Index, key: str, known: set[str]) -> bool:
    """Adopt ``<ns>/config.json`` into the namespaces table; False if it is not one or does not check out."""
    try:
        namespace = parse_config_key(key)
    except InvalidKey:
        return False
    if namespace in known:
        return True
    raw = await _read_small(store, key)
    try:
        fields = json.loads(raw) if raw is not None else None
        if not isinstance(fields, dict):
            return False
        check_namespace_fields(namespace, fields)
    except (ValueError, InvalidKey):
        return False
    await index.put_namespace(name=namespace, fields=fields)
    known.add(namespace)
    return True


async def _drop_stale_parts(
    store: BlockStore, index: Index, objects: list[ObjectInfo], *, older_than_s: float, report: ReconcileReport
) -> None:
    cutoff = time.time() - older_than_s
    uploads = await index.parts_summary()
    described = {store_key for _, keys in uploads.values() for store_key in keys}
    for key, (oldest, store_keys) in uploads.items():
        if oldest > cutoff:
            continue
        for store_key in store_keys:
            report.part_objects_removed += int(await store.delete(store_key))
        await index.delete_parts(key)
        report.stale_uploads_dropped += 1
        log.warning("reconcile: dropped incomplete upload key=%s parts=%s", key, len(store_keys))
    for info in objects:  # data of a part whose row never committed (or was dropped above)
        if info.key not in described and info.mtime <= cutoff:
            report.part_objects_removed += int(await store.delete(info.key))


async def reconcile(
    *,
    service: BlockService,
    concurrency: int = 8,
    temp_older_than_s: float = 0.0,
    stale_parts_s: float = 3600.0,
    progress: Progress | None = None,
) -> ReconcileReport:
    """Make the index agree with the store; returns what changed. Safe to run again at any time."""
    began = time.monotonic()
    store, index = service.store, service.index
    report = ReconcileReport()
    note = progress or (lambda _phase, _done, _total: None)
    remove_temp = getattr(store, "remove_temp_files", None)
    if remove_temp is not None:
        report.temp_removed = int(await remove_temp(older_than_s=temp_older_than_s))
    versioned = bool(getattr(store, "versioned", False))

    rows = await index.block_versions()
    current: dict[str, ObjectInfo] = {}  # the object each key's reader would open
    extra: list[ObjectInfo] = []  # versions no row names (S3): a write that never committed, or one replaced
    others: list[str] = []
    part_objects: list[ObjectInfo] = []
    async for info in store.list():
        if info.key.startswith(PARTS_PREFIX):
            part_objects.append(info)
            continue
        try:
            if parse_block_key(info.key).path != info.key:
                raise InvalidKey(info.key)
        except InvalidKey:
            others.append(info.key)
            continue
        if not versioned:
            current[info.key] = info
        elif info.stamp is not None and info.stamp != rows.get(info.key, (0, None))[1]:
            extra.append(info)
        elif info.stamp is None and info.key in rows and rows[info.key][1] is not None:
            extra.append(info)  # an unversioned object superseded by a version
        else:
            current[info.key] = info
    note("scan", len(current), len(current))

    missing = [k for k in rows if k not in current]
    report.rows_dropped = await service.forget(missing)
    todo: list[ObjectInfo] = []
    doubtful: list[str] = []
    legacy: dict[str, str] = {}
    written_before = getattr(store, "written_before", None)
    for key, info in current.items():
        row = rows.get(key)
        if row is None:
            todo.append(info)  # data without a row: adopt
        elif row[1] is None and row[0] == info.size:
            if info.stamp is not None:
                legacy[key] = info.stamp  # a row from before 0003: trusted as before, now stamped
        elif row != (info.size, info.stamp):
            report.resized += 1
            if info.stamp is not None and written_before is not None and written_before(info.stamp, row[1]):
                todo.append(info)  # the version before the row's: a crash between the row and the rename
            else:
                doubtful.append(key)  # changed behind our back: the row's bytes, or corruption
    await index.set_stamps(legacy)

    sem = asyncio.Semaphore(concurrency)

    async def verify(key: str) -> None:
        async with sem:
            if not await service.repair(parse_block_key(key)):
                report.corrupt_removed += 1

    await asyncio.gather(*(verify(k) for k in doubtful))
    done = 0
    records: list[BlockRecord] = []

    async def adopt(info: ObjectInfo) -> None:
        nonlocal done
        async with sem:
            try:
                meta = await store.digest(info.key)
            except BlockNotFound:
                meta = None  # removed while we walked
        done += 1
        if done % 256 == 0 or done == len(todo):
            note("digest", done, len(todo))
        if meta is None:
            return
        key = parse_block_key(info.key)
        records.append(
            BlockRecord(
                key=info.key,
                namespace=key.namespace,
                rank=key.rank,
                group=key.group,
                size=meta.size,
                digest=meta.digest,
                created_at=info.mtime,
                last_access=info.mtime,
                hits=0,
                stamp=meta.stamp,
            )
        )

    note("digest", 0, len(todo))
    await asyncio.gather(*(adopt(info) for info in todo))
    note("write", 0, len(records))
    await service.adopt_records(records)
    note("write", len(records), len(records))
    report.adopted = len(records) - (report.resized - len(doubtful))

    cutoff = time.time() - stale_parts_s
    for info in extra:  # uncommitted or replaced versions, once no writer can still be committing them
        if info.mtime <= cutoff:
            await store.remove(info.key, stamp=info.stamp)
            report.stale_versions_removed += 1

    known = set(await index.namespace_names())
    for key in others:
        before = len(known)
        if await _adopt_config(store, index, key, known):
            report.configs_adopted += len(known) - before
        else:
            report.left_alone.append(key)
            log.warning("reconcile: left alone key=%s (neither a block nor a valid namespace config)", key)

    await _drop_stale_parts(store, index, part_objects, older_than_s=stale_parts_s, report=report)
    remove_dirs = getattr(store, "remove_empty_dirs", None)
    if remove_dirs is not None:  # uploads of earlier versions had a directory each under _parts/
        report.part_dirs_removed = int(await remove_dirs(PARTS_PREFIX, older_than_s=stale_parts_s))

    usage = await index.namespace_usage()
    report.blocks = sum(u.blocks for u in usage)
    report.bytes = sum(u.bytes for u in usage)
    report.seconds = time.monotonic() - began
    log.info(
        "reconcile dropped=%s adopted=%s in_doubt=%s configs=%s temp=%s blocks=%s bytes=%s in %.2fs",
        report.rows_dropped,
        report.adopted,
        report.resized,
        report.configs_adopted,
        report.temp_removed,
        report.blocks,
        report.bytes,
        report.seconds,
    )
    return report
