"""Reconcile the index with the store: at start-up and from ``kvgate gc``, beside live gateways if there are any.

A snapshot of the rows and a listing of the store (which can take minutes on a large bucket) only choose the keys
to look at again; every decision is made afresh by upkeep, holding the key, and commits only if the key is still
what it read there (see app/core/upkeep.py). So reconcile is safe to run at any time, from any process, while
gateways write: a key written after the snapshot is either left alone or found as it is now.

- staged data left by crashes: published if a committed row names it (roll forward), else removed;
- a row whose data is another version than it names, or is missing: settled by ``Upkeep.repair`` (the staged
  version published; the row's bytes kept under a new stamp; a version this store wrote, recorded; data changed
  behind the gateway's back, removed with its row; a row without data, dropped);
- data without a row: adopted (hashed; namespace/rank/group from the key) if still without a row;
- rows of an earlier release (stamps without version ids): given ids, without reading the data;
- S3 versions that no row names (a write that never committed, a replaced version): removed once older than
  ``stale_parts_s``;
- keys that are not block keys: ``<ns>/config.json`` is adopted into the namespaces table if its fields hash to the
  name; anything else is left alone and logged;
- incomplete multi-part uploads with no part for ``stale_parts_s`` are dropped (rows, then data), and so is part
  data that no row describes.

One key's failure to reach the index (``IndexUnavailable``: a refused connection, a COMMIT whose reply was lost) or
the store (``BackendUnavailable``) defers that key and nothing else: it is left as it is, counted in ``deferred``
and logged, for the next reconcile (``kvgate gc``, the next start) to look at afresh, which is safe since each key's
decision is made again from what it finds. A whole reconcile stopped by one lost reply began again from the listing
at the next start-up try, and under a link that loses one reply in a few hundred never finished. The tail steps
defer the same way, each alone: a config's adoption, the sweep of idle uploads, the sweep of part objects (all of it
when the uploads' rows cannot be read: which parts are described is unknown), the removal of empty part
directories. The reads the whole depends on (the snapshot, the listing, the namespaces' names, the expired intents,
the usage) have nothing to decide from without them: at start-up each is tried again in place until start-up's
deadline (``until``, app/core/patience.py), so that one lost reply there no longer begins the whole start-up again;
``kvgate gc`` fails at its first loss. The versions no row names and the expired intents are retired as the keys
above are, several at once, each deferred alone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from app.core.parts import PARTS_PREFIX
from app.core.patience import patiently
from app.core.upkeep import Settled, Upkeep
from app.core.versions import STAGED_MAX_AGE_S
from app.errors import BackendUnavailable, CorruptData, IndexUnavailable
from app.index import Index
from app.index.staging import PART
from app.storage import BlockStore, ObjectInfo
from contract.keys import InvalidKey, check_namespace_fields, parse_block_key, parse_config_key

log = logging.getLogger("kvgate.reconcile")

Progress = Callable[[str, int, int], None]
"""progress(phase, done, total): phases 'scan', 'settle' (rows in doubt), 'digest' (data without a row, hashed)."""


@dataclass(slots=True)
class ReconcileReport:
    rows_dropped: int = 0
    adopted: int = 0
    resized: int = 0
    """Rows whose data was another version than they named (settled one by one)."""
    rolled_forward: int = 0
    stamps_upgraded: int = 0
    configs_adopted: int = 0
    temp_removed: int = 0
    stale_uploads_dropped: int = 0
    part_objects_removed: int = 0
    part_dirs_removed: int = 0
    stale_versions_removed: int = 0
    corrupt_removed: int = 0
    deferred: int = 0
    """Keys left as they were for the next reconcile: the index or the store failed on them (logged)."""
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


async def _gather(limit: int, jobs: list[Coroutine[Any, Any, object]], report: ReconcileReport) -> None:
    sem = asyncio.Semaphore(limit)

    async def one(job: Coroutine[Any, Any, object]) -> None:
        async with sem:
            await _deferring(job, report)

    await asyncio.gather(*(one(j) for j in jobs))


async def _deferring(job: Coroutine[Any, Any, Any], report: ReconcileReport) -> Any:
    """``job`` (one key's step), or None with the key deferred if the index or the store failed on it."""
    try:
        return await job
    except (IndexUnavailable, BackendUnavailable) as exc:
        report.deferred += 1
        log.warning("reconcile: deferred a key to the next reconcile: %s: %s", type(exc).__name__, exc)
        return None


async def reconcile(
    *,
    upkeep: Upkeep,
    store: BlockStore,
    index: Index,
    concurrency: int = 8,
    stale_parts_s: float = 3600.0,
    progress: Progress | None = None,
    until: float | None = None,
) -> ReconcileReport:
    """Make the index agree with the store; returns what changed. Safe to run again, and beside live gateways.
    ``until``: the reads that the whole depends on (the snapshot, the listing, the namespaces' names, the expired
    intents, the usage) are each tried again in place while the index or the store cannot be reached, until then
    (``time.monotonic()``; start-up's deadline), instead of failing the whole at their first loss."""
    began = time.monotonic()
    report = ReconcileReport()
    note = progress or (lambda _phase, _done, _total: None)

    for leftover in await patiently(store.leftovers, what="leftovers", until=until):
        outcome = await _deferring(upkeep.settle_leftover(leftover), report)
        report.temp_removed += outcome == "dropped"
        report.rolled_forward += outcome == "rolled"

    rows = await patiently(index.scans.block_versions, what="snapshot", until=until)
    listing = await patiently(lambda: _listing(store), what="listing", until=until)
    listed: dict[str, ObjectInfo] = {}  # the object each key's reader would open (a versioned store: the row's)
    extra: list[ObjectInfo] = []  # versions no row named when listed (S3): uncommitted, or replaced
    others: list[str] = []
    part_objects: list[ObjectInfo] = []
    for info in listing:
        if info.key.startswith(PARTS_PREFIX):
            part_objects.append(info)
            continue
        try:
            if parse_block_key(info.key).path != info.key:
                raise InvalidKey(info.key)
        except InvalidKey:
            others.append(info.key)
            continue
        row = rows.get(info.key)
        if store.versioned and info.stamp != (row[1] if row else None) and not (row is None and info.stamp is None):
            extra.append(info)
        else:
            listed[info.key] = info
    note("scan", len(listed), len(listed))

    doubtful = [k for k, (size, stamp) in rows.items() if k not in listed or (size, stamp) != _seen(listed[k])]
    legacy = [k for k, (_, stamp) in rows.items() if k in listed and _seen(listed[k]) == rows[k]]
    legacy = [k for k in legacy if not store.issued(rows[k][1]) and rows[k][1] is not None]
    orphans = [k for k in listed if k not in rows]
    report.resized = sum(1 for k in doubtful if k in listed)

    done = 0

    async def settle(key: str) -> None:
        nonlocal done
        outcome = await upkeep.repair(parse_block_key(key))
        report.corrupt_removed += outcome is Settled.CORRUPT
        report.rows_dropped += outcome is Settled.DROPPED
        report.rolled_forward += outcome is Settled.ROLLED
        done += 1
        note("settle", done, len(doubtful))

    await _gather(concurrency, [settle(k) for k in doubtful], report)

    async def upgrade(key: str) -> None:
        stamp = rows[key][1]
        if stamp is not None and await upkeep.upgrade_stamp(parse_block_key(key), stamp=stamp):
            report.stamps_upgraded += 1

    await _gather(concurrency, [upgrade(k) for k in legacy], report)

    adopted = 0

    async def adopt(key: str) -> None:
        nonlocal adopted
        before = await index.get(key)
        try:
            meta = await upkeep.adopt(parse_block_key(key))
        except CorruptData:  # moved aside, never adopted
            report.corrupt_removed += 1
        else:
            report.adopted += meta is not None and before is None
        adopted += 1
        if adopted % 256 == 0 or adopted == len(orphans):
            note("digest", adopted, len(orphans))

    note("digest", 0, len(orphans))
    await _gather(concurrency, [adopt(k) for k in orphans], report)

    # versions no row names (uncommitted, or replaced), once no writer can still be committing them: told by the
    # index's staging intents and its clock (app/index/staging.py), never by this machine's clock against the store's
    unnamed_age = max(stale_parts_s, 2 * STAGED_MAX_AGE_S)

    async def retire(info: ObjectInfo) -> None:
        if await upkeep.retire_unnamed(info.key, stamp=info.stamp, older_than_s=unnamed_age):
            report.stale_versions_removed += 1

    await _gather(concurrency, [retire(info) for info in extra], report)
    swept = {(info.key, info.stamp) for info in extra} | {(info.key, PART) for info in part_objects}
    expired = await patiently(
        lambda: index.staging.expired_intents(older_than_s=unnamed_age), what="expired intents", until=until
    )
    gone = [(key, stamp) for key, stamp in expired if (key, stamp) not in swept]  # writers gone, objects not listed
    await _gather(
        concurrency,
        [
            upkeep.retire_unnamed(key, stamp=stamp, older_than_s=unnamed_age)
            if stamp != PART
            else _retire_part_object(store, index, key, older_than_s=unnamed_age)
            for key, stamp in gone
        ],
        report,
    )

    # the tail: each step (a config, the idle uploads' sweep, a part object) deferred alone, as a key's above
    known = set(await patiently(index.scans.namespace_names, what="namespace names", until=until))
    for key in others:
        before = len(known)
        config = await _deferring(_adopt_config(store, index, key, known), report)
        if config:
            report.configs_adopted += len(known) - before
        elif config is not None:
            report.left_alone.append(key)
            log.warning("reconcile: left alone key=%s (neither a block nor a valid namespace config)", key)

    report.stale_uploads_dropped = await _deferring(upkeep.drop_idle_uploads(idle_s=stale_parts_s), report) or 0
    described = await _deferring(_described_parts(index), report)
    cutoff = time.time() - stale_parts_s  # in-place uploads (one machine's files): their mtime is this clock's

    async def sweep(info: ObjectInfo) -> None:  # data of a part whose row never committed (or was dropped above)
        if store.uploads and info.mtime > cutoff:
            return
        if not store.uploads and not await index.staging.claim_part_object(
            store_key=info.key, older_than_s=unnamed_age
        ):
            return  # being written (its intent is young by the index's clock), or recorded since the listing
        report.part_objects_removed += int(await store.delete(info.key))

    for info in part_objects if described is not None else ():  # not knowing which are described: none swept
        if info.key not in described:
            await _deferring(sweep(info), report)
    empty = store.remove_empty_dirs(PARTS_PREFIX, older_than_s=stale_parts_s)
    report.part_dirs_removed = await _deferring(empty, report) or 0

    usage = await patiently(index.scans.namespace_usage, what="usage", until=until)
    report.blocks = sum(u.blocks for u in usage)
    report.bytes = sum(u.bytes for u in usage)
    report.seconds = time.monotonic() - began
    log.info(
        "reconcile dropped=%s adopted=%s in_doubt=%s rolled_forward=%s configs=%s temp=%s deferred=%s blocks=%s"
        " bytes=%s in %.2fs",
        report.rows_dropped,
        report.adopted,
        report.resized,
        report.rolled_forward,
        report.configs_adopted,
        report.temp_removed,
        report.deferred,
        report.blocks,
        report.bytes,
        report.seconds,
    )
    return report


async def _listing(store: BlockStore) -> list[ObjectInfo]:
    """The store's whole listing (begun again from its start when tried again)."""
    return [info async for info in store.list()]


async def _described_parts(index: Index) -> set[str]:
    """The store keys of every part an upload's rows describe."""
    return {p.store_key for u in await index.scans.uploads() for p in await index.get_parts(u.key)}


async def _retire_part_object(store: BlockStore, index: Index, key: str, *, older_than_s: float) -> None:
    if await index.staging.claim_part_object(store_key=key, older_than_s=older_than_s):
        await store.delete(key)


def _seen(info: ObjectInfo) -> tuple[int, str | None]:
    return info.size, info.stamp
