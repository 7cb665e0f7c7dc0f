"""A key's life: the one module that changes a key's row or its stored version.

Every change of a key, whoever makes it (a PUT, a part that completes an object, a DELETE, an eviction, a purge,
reconcile at start-up, ``kvgate gc``, ``kvgate import``, in this process or another), goes through
``Versions.change(key)``, which holds the key (``KeyLocks``: this process's lock, then the key's stripe lock in the
data directory's coordination file, so that every process on the machine sees the key's changes one at a time) and
hands out a ``Change``. A ``Change`` does one thing at a time, in one order:

1. a new version is written in full and checked, invisible, before the key is held (``BlockStore.stage``);
2. one index transaction swaps the key's row to it, **if the row is what the change expects**: whatever is there
   (a PUT), nothing (create-only, adoption of data found without a row), or the very version the change observed
   (everything decided from an earlier look: reconcile, gc, import, eviction, repair). This is the write's point in
   the key's history, and it is conditional, so a decision made from a stale snapshot can never undo a newer write;
3. the store publishes the version (the filesystem's rename and directory fsync; nothing on S3, where the row names
   the object). If publishing fails the row stays: the version is committed, and recovery rolls it forward
   (``BlockStore.roll_forward``) rather than back, so HEAD, lookup and GET never go back in the key's history.

A commit whose outcome is unknown (the index's COMMIT failed: the connection dropped with it, its reply was lost;
``CommitUnknown``) is never run again and never undone on a guess: the key's row is read back (``Index.settled``,
which waits for the transaction to end). If it names this change's version the change stands, and goes on to step
3 as if the reply had come; if it does not, nothing was written, the staged data is dropped and the change fails
(503); if the row cannot be read, the staged version is kept for recovery (``BlockStore.release``: published if the
row names it, dropped if not) and the change fails (503). A removal asks the same of its row: gone, or not.

Removal is the same in reverse: the row goes first (only if it names the version expected), then whatever data
the key holds (its file, whichever version, and the staged version the row named, which a crash may have left
unpublished), durably (the filesystem fsyncs the directory) before the change returns. Events and the usage figures move
only by what committed. Readers never hold a key: a reader opens exactly the version its row names (stamps never
repeat), and one that finds another version waits for the change in flight (``settle``) and reads again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass

from app.core.arrivals import Arrivals
from app.core.event_sink import NO_EVENTS, EventSink, PutInProgress
from app.core.keystate import KeyLocks, MetaCache
from app.core.usage import Usage
from app.errors import BackendUnavailable, CommitUnknown, IndexUnavailable, KVGateError, StagingExpired
from app.index import ANY, BlockRecord, Expect, Index, Swap
from app.storage import BlockStore
from app.storage.base import Staged, Version
from app.storage.checksums import Chunks
from contract.keys import BlockKey

log = logging.getLogger("kvgate.versions")

STAGED_MAX_AGE_S = 300.0
"""A version staged longer ago than this is not committed (503; the writer retries): on a store that keeps each
version as an object (S3), reconcile removes objects that no row names once they are older than twice this, so a
commit can never name an object that a sweep is removing."""
RETIRE_AFTER_S = 5.0
"""A replaced or removed version object (S3) is deleted this long after its row stopped naming it, so that a GET
that opened it just before has started reading it (an S3 GET in progress reads to the end after a delete)."""


def row_for(key: BlockKey, version: Version, *, stamp: str | None, created_at: float) -> BlockRecord:
    """The index row of ``version`` of ``key``: new, unread (its last access is its creation), with the version's
    chunk CRCs where it has them (a Range GET of it is vouched for from them: app/core/reads.py)."""
    chunks = version.chunks if version.chunks is not None and version.chunks.fits(version.size) else None
    return BlockRecord(
        key=key.path,
        namespace=key.namespace,
        rank=key.rank,
        group=key.group,
        size=version.size,
        digest=version.digest,
        created_at=created_at,
        last_access=created_at,
        hits=0,
        stamp=stamp,
        chunk_bytes=None if chunks is None else chunks.size,
        chunk_sums=None if chunks is None else chunks.sums,
    )


def meta_of(record: BlockRecord) -> Version:
    chunks = None
    if record.chunk_bytes is not None and record.chunk_sums is not None:
        with contextlib.suppress(ValueError):  # chunk CRCs that make no sense: the range is checked whole instead
            chunks = Chunks(record.chunk_bytes, record.chunk_sums)
    return Version(key=record.key, size=record.size, digest=record.digest, stamp=record.stamp, chunks=chunks)


@dataclass(frozen=True, slots=True)
class Committed:
    """What a commit found and did."""

    meta: Version
    """The key's version now (the new one if written, else the one kept)."""
    old: BlockRecord | None
    """The row before the change."""
    written: bool
    """A new version was recorded (False: the row was not what the change expected, or held the same bytes)."""


class Versions:
    def __init__(
        self,
        *,
        store: BlockStore,
        index: Index,
        locks: KeyLocks,
        cache: MetaCache,
        usage: Usage,
        events: EventSink = NO_EVENTS,
        retire_after_s: float = RETIRE_AFTER_S,
    ) -> None:
        self.store = store
        self.index = index
        self._locks = locks
        self._cache = cache
        self._events = events
        self._usage = usage
        self._retire_after_s = retire_after_s
        self._retiring: set[asyncio.Task[None]] = set()
        self.arrivals = Arrivals()
        """Lookups waiting for a key, woken by its commit here (app/core/arrivals.py)."""

    async def close(self) -> None:
        """Stop pending deletions of retired versions (objects no row names: reconcile removes them later)."""
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)

    # -- reads ------------------------------------------------------------------------------------------------

    async def read(self, key: str, *, fresh: bool = False) -> Version | None:
        """The version the key's row names (from the cache unless ``fresh``), or None."""
        meta = None if fresh else self._cache.get(key)
        if meta is not None:
            return meta
        epoch = self._cache.epoch_of(key)
        record = await self.index.get(key)
        if record is None:
            return None
        meta = meta_of(record)
        if not self._locks.held(key):
            self._cache.fill(meta, read_at_epoch=epoch)
        return meta

    def cached(self, key: str) -> Version | None:
        """The version the key's row names as the metadata cache holds it (None: not cached); the index is not
        asked."""
        return self._cache.get(key)

    async def settle(self, key: str) -> None:
        """Wait for a change of ``key`` in flight (here or in another process) to finish."""
        self._cache.drop(key)
        await self._locks.settle(key)

    # -- changes ----------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def change(self, key: str, *, put: PutInProgress | None = None) -> AsyncIterator[Change]:
        """Hold ``key`` for one change (see the module docstring); ``put``: the PUT making it, for the KV events."""
        async with self._locks.hold(key) as held:
            self._cache.drop(key)
            change = Change(self, key, put)
            yield change
        if change.made is not None:
            self._cache.made(change.made, epoch=held.end_epoch)

    # -- what a committed change moves ------------------------------------------------------------------------

    def _stored(self, record: BlockRecord, old: BlockRecord | None, put: PutInProgress | None) -> None:
        self._events.stored(record, put)
        self.arrivals.committed(record.key)
        self._moved(record.namespace, 0 if old else 1, record.size - (old.size if old else 0))
        if old is not None and self.store.versioned and old.stamp != record.stamp:
            self._retire(old.key, old.stamp)

    def _removed(self, old: BlockRecord) -> None:
        self._events.removed(old)
        self._moved(old.namespace, -1, -old.size)

    def _moved(self, namespace: str, blocks: int, nbytes: int) -> None:
        if blocks or nbytes:
            self._usage.add(namespace=namespace, blocks=blocks, nbytes=nbytes)

    def parts_moved(self, namespace: str, nbytes: int) -> None:
        """Stored parts of an incomplete object were recorded (+) or dropped (-)."""
        self._moved(namespace, 0, nbytes)

    def _retire(self, key: str, stamp: str | None) -> None:
        """Delete a version object (S3) that no row names any more, after ``retire_after_s``."""

        async def later() -> None:
            await asyncio.sleep(self._retire_after_s)
            try:
                await self.store.remove(key, stamp=stamp)
            except KVGateError as exc:  # an object no row names: reconcile removes it
                log.warning("could not remove retired version key=%s stamp=%s: %s", key, stamp, exc)

        task = asyncio.get_running_loop().create_task(later(), name="kvgate-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def stage(
        self,
        key: str,
        body: AsyncIterable[bytes],
        *,
        size: int,
        expected_digest: str | None = None,
        algorithm: str | None = None,
    ) -> Staged:
        """Step 1: write and check a new version of ``key``, unseen. On a versioned store its staging intent is
        recorded first, by the index's clock (app/index/staging.py): no sweep removes the object while it may still
        commit, and the commit is refused once a sweep has taken it, whatever the machines' clocks say."""
        stamp = self.store.new_stamp()
        if stamp is not None:
            await self.index.staging.add_intent(key=key, stamp=stamp)
        try:
            return await self.store.stage(
                key, body, size=size, expected_digest=expected_digest, algorithm=algorithm, stamp=stamp
            )
        except BaseException:
            if stamp is not None:
                with contextlib.suppress(KVGateError):  # else an old intent, which a sweep removes
                    await self.index.staging.drop_intent(key=key, stamp=stamp)
            raise

    async def discard(self, staged: Staged, *, intent: bool = True) -> None:
        """Drop a staged version (and its staging intent, unless a transaction took it already: ``intent``)."""
        try:
            await self.store.discard(staged)
            if intent and self.store.versioned:
                await self.index.staging.drop_intent(key=staged.key, stamp=staged.stamp)
        except KVGateError as exc:  # a leftover: the next sweep removes it (no row names it)
            log.warning("could not drop staged data key=%s: %s", staged.key, exc)


class Change:
    """One key held for one change (``Versions.change``): its methods are the only ways its row and data move."""

    def __init__(self, versions: Versions, key: str, put: PutInProgress | None = None) -> None:
        self._v = versions
        self.key = key
        self._put = put
        self.made: Version | None = None
        """The version this change left the key with, for the cache once the key is released."""

    async def row(self) -> BlockRecord | None:
        """The key's row now (read while the key is held: no change of it can commit meanwhile, in any process on
        this machine; across machines, the conditional writes below still refuse what is stale)."""
        return await self._v.index.get(self.key)

    async def commit(self, key: BlockKey, staged: Staged, *, expect: Expect = ANY) -> Committed:
        """Make ``staged`` the key's version if the row is what ``expect`` says (steps 2 and 3 of the module
        docstring); the staged data is dropped when nothing is written."""
        v = self._v
        if v.store.versioned and time.monotonic() - staged.staged_at > STAGED_MAX_AGE_S:
            await v.discard(staged)
            raise BackendUnavailable(f"{key.path!r}: staged {STAGED_MAX_AGE_S:.0f}+ s ago, too long to commit")
        record = row_for(key, staged.meta, stamp=staged.stamp, created_at=time.time())
        intent = staged.stamp if v.store.versioned else None
        try:
            note = v._events.note(key.path, self._put)
            swap = await v.index.swap_block(record, expect=expect, note=note, intent=intent)
        except CommitUnknown as exc:
            try:
                swap = await self._settle_swap(record, exc)
            except CommitUnknown:
                await v.store.release(staged)  # for recovery to publish or drop, by the row
                raise
            except BaseException:
                await v.discard(staged)
                raise
        except BaseException:
            await v.discard(staged)
            raise
        if swap.fenced:  # a sweep took the staged version (it waited too long, by the index's clock): never commit
            await v.discard(staged, intent=False)
            raise StagingExpired(f"{key.path!r}: the staged version was swept before its commit")
        if not swap.written:
            await v.discard(staged, intent=False)  # the swap took the intent
            kept = None if swap.old is None else meta_of(swap.old)
            self.made = kept
            return Committed(meta=kept or meta_of(record), old=swap.old, written=False)
        v._stored(record, swap.old, self._put)
        await v.store.publish(staged)  # if this fails the row stays: recovery rolls the version forward
        self.made = meta_of(record)
        return Committed(meta=self.made, old=swap.old, written=True)

    async def record(
        self, key: BlockKey, stored: Version, *, expect: Expect, created_at: float | None = None
    ) -> Committed:
        """Record a version that is already in place (found by reconcile or import, re-stamped, or the one left
        on disk when the row's own is gone), if the row is what ``expect`` says."""
        v = self._v
        record = row_for(key, stored, stamp=stored.stamp, created_at=time.time() if created_at is None else created_at)
        try:
            swap = await v.index.swap_block(record, expect=expect, note=v._events.note(key.path, None))
        except CommitUnknown as exc:
            swap = await self._settle_swap(record, exc)
        if not swap.written:
            return Committed(meta=meta_of(swap.old) if swap.old else meta_of(record), old=swap.old, written=False)
        if swap.old is None or (swap.old.digest, swap.old.size) != (record.digest, record.size):
            v._stored(record, swap.old, None)  # other bytes: a new version; a re-stamp of the same bytes is not news
        self.made = meta_of(record)
        return Committed(meta=self.made, old=swap.old, written=True)

    async def remove(self, *, expect: Expect = ANY, data: bool = True) -> BlockRecord | None:
        """Remove the key's row if it is what ``expect`` says, then (``data``) that version's data, durably; the
        row removed, or None. ``data=False``: the data is known to be gone already. If removing the data fails
        the error propagates (the row is gone; the data is adopted again unless the removal is retried), so that
        nobody is told of a removal that a restart could undo."""
        v = self._v
        try:
            old = await v.index.remove_block(self.key, expect=expect)
        except CommitUnknown as exc:
            old = await self._settle_removal(exc)
        if old is None:
            return None
        v._removed(old)
        if data and v.store.versioned:
            v._retire(self.key, old.stamp)
        elif data:
            # whatever the key holds goes, not only the row's version: a crash between a commit and its rename
            # leaves the row naming a staged version and the old file under the key, which recovery would adopt
            # again (an open reader's fd keeps its inode)
            await v.store.clear(self.key, stamp=old.stamp)
        return old

    async def _settle_swap(self, record: BlockRecord, unknown: CommitUnknown) -> Swap:
        """The swap whose commit's outcome is unknown, if the key's row read back names its version; otherwise
        IndexUnavailable (nothing was written), or ``unknown`` again if the row cannot be read."""
        swap = unknown.result
        if not isinstance(swap, Swap):
            raise unknown
        if not swap.written:
            return swap  # the transaction changed nothing: its answer holds whatever became of it
        now = await self._settled(unknown)
        if now is not None and now.stamp is not None and now.stamp == record.stamp:
            log.warning("commit reply lost, the row names this change's version: it stands key=%s", self.key)
            return swap
        raise IndexUnavailable(f"{self.key!r}: the commit failed and the row does not name its version") from unknown

    async def _settle_removal(self, unknown: CommitUnknown) -> BlockRecord | None:
        """The row a removal whose commit's outcome is unknown took away, if the key's row read back is gone (or
        names another version); otherwise IndexUnavailable (nothing was removed), or ``unknown`` again."""
        old = unknown.result
        if old is None:
            return None  # the transaction found nothing to remove
        if not isinstance(old, BlockRecord):
            raise unknown
        now = await self._settled(unknown)
        if now is None or now.stamp != old.stamp:
            log.warning("commit reply lost, the removed row is gone: the removal stands key=%s", self.key)
            return old
        raise IndexUnavailable(f"{self.key!r}: the removal's commit failed and the row is still there") from unknown

    async def _settled(self, unknown: CommitUnknown) -> BlockRecord | None:
        """The key's row read back after ``unknown`` (``unknown`` again if it cannot be read); usage is not read
        from the index meanwhile (the commit may be there, and not yet in the view)."""
        usage = self._v._usage
        usage.settling += 1
        try:
            return await self._v.index.settled(self.key)
        except IndexUnavailable as exc:
            raise unknown from exc
        finally:
            usage.settling -= 1
