"""The KV event log in the index: a row per committed change of a block, the published batches, the publisher's state.

**Writing.** While the index logs events (``Index(events=True)``: every process reads the same setting, so a gateway,
``kvgate gc`` and ``kvgate import`` agree), ``Index.swap_block`` and ``Index.remove_block`` add the change's row in
the change's own transaction (``EventLog._log``, inside their ``run(conn)``): a row exists iff its change
committed, whoever committed it. A swap is news when the key had no row or other bytes (a re-stamp of the same bytes
is not). The writer's block meta and the PUTs of the parent it waits for come with the call (``LogNote``).

**Order.** The log's order is its ids, and a key's rows are in its commit order: each change of a key holds the
key (its lock on PostgreSQL, SQLite's one writer) to its commit, and takes its row's id under it. On SQLite one
writer commits at a time, so ids also come in commit order and every row a reader sees is final. On PostgreSQL an id
is taken at insert and becomes visible at commit: a transaction holding id 7 may commit after id 8 was read, so
"id > last seen" would skip 7 for ever. Reading only rows of transactions older than the oldest one running does not
help either: published band by band, rows come in transaction-id order, and a transaction gets its id at its first
write, possibly before it waits for a key that an older-numbered one changes first (each key's order would break).
So the reader (``Horizon``) notes the largest id it sees and then takes a transaction id of its own: every smaller
row id was taken by a transaction older than that one (a row is inserted only after its transaction has written, so
it has its transaction id when it takes its row id), and once every transaction older than it has ended (the oldest
one running, read after it ended, is newer), the rows up to that id are final. A snapshot's own xmax will not do:
it is one past the newest transaction that has *ended*, so a transaction that took its id after that one and still
runs is neither listed in it nor below its xmin (found by the router's-eye test: a row skipped for ever).

**Publishing** (app/events/publisher.py) stores each batch (its sequence number, topic and rows) with the new
next number, the last row covered and the rows held for their parents, in one transaction conditional on the
publisher's term (``EventLog.persist``): a publisher that lost its turn can write nothing. The log is trimmed below the
oldest batch kept.
"""

from __future__ import annotations

import functools
import json
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, insert, select, text, update

from app.index.models import EventBatchRow, EventLogRow, EventState
from app.index.records import BlockRecord, LogNote, Swap
from app.index.writer import GroupCommit

STORED, REMOVED, RELEASE, CONFIG_REMOVED = 0, 1, 2, 3
"""Kinds of log rows: a block's version stored, its row removed, a PUT of the key ended without a store, a
namespace's config removed (the key is the namespace; the row names the config's model)."""
STREAM = "kv"
"""The one stream's name in the ``event_state`` table."""
ROWS_CHUNK = 2000


@dataclass(frozen=True, slots=True)
class LogRow:
    id: int
    kind: int
    key: str
    size: int
    digest: str
    meta: str | None
    """The block meta the writer sent, as it sent it (``LogNote.meta``); None: none."""
    waits_for: tuple[int, ...]
    """Tokens of the PUTs of the parent this row waits for (app/events/order.py)."""
    token: int | None
    """The token of the PUT that wrote it, when rows wait for that PUT."""
    model: str | None = None
    """Of a config's removal: the model its config named."""


@dataclass(frozen=True, slots=True)
class LogState:
    term: int
    next_seq: int
    last_id: int
    """Every row up to this one is published, dropped or held."""
    held: tuple[int, ...]
    """Rows waiting for their parent's."""
    waiting: dict[int, str]
    """Token of each PUT those still wait for -> its key."""


@dataclass(frozen=True, slots=True)
class LoggedBatch:
    seq: int
    ts: float
    topic: str
    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the reader saw: the largest row id visible, a transaction id newer than every one that took an id up to it
    (``xmax``), and the oldest transaction running after that one ended (``xmin``); SQLite: 0, 0 and the largest id
    (every row visible is final)."""

    xmin: int
    xmax: int
    max_id: int


class Horizon:
    """The largest log id at or below which every row is final, from successive snapshots (see the module doc)."""

    def __init__(self, *, max_marks: int = 1024) -> None:
        self.safe = 0
        self._max_marks = max_marks
        self._marks: deque[tuple[int, int]] = deque()
        """(xmax, largest id seen) of snapshots taken while transactions ran, oldest first."""

    def advance(self, snap: Snapshot) -> int:
        marks = self._marks
        if snap.xmin >= snap.xmax:  # nothing was running: every id it saw, and every smaller one, is final
            marks.clear()
            self.safe = max(self.safe, snap.max_id)
            return self.safe
        if marks and marks[-1][0] >= snap.xmax:
            marks[-1] = (marks[-1][0], max(marks[-1][1], snap.max_id))
        else:
            marks.append((snap.xmax, snap.max_id))
        if len(marks) > self._max_marks:  # a long transaction holds the horizon: wait for the later of two marks
            later = marks.pop()
            earlier = marks.pop()
            marks.append((later[0], max(earlier[1], later[1])))
        while marks and marks[0][0] <= snap.xmin:
            self.safe = max(self.safe, marks.popleft()[1])
        return self.safe


def _ids(text_: str) -> tuple[int, ...]:
    return tuple(int(i) for i in text_.split(",")) if text_ else ()


def _join(values: Iterable[int]) -> str:
    return ",".join(map(str, values))


def _log_row(r: Any) -> LogRow:
    return LogRow(
        id=int(r[0]),
        kind=int(r[1]),
        key=r[2],
        size=int(r[3]),
        digest=r[4],
        meta=r[5],
        waits_for=_ids(r[6] or ""),
        token=None if r[7] is None else int(r[7]),
        model=r[8],
    )


_LOGGED = ("kind", "key", "size", "digest", "meta", "waits_for", "token")
"""The columns a change's row is written with, in the order of ``EventLog._log``'s values."""

_COLUMNS = (
    EventLogRow.id,
    EventLogRow.kind,
    EventLogRow.key,
    EventLogRow.size,
    EventLogRow.digest,
    EventLogRow.meta,
    EventLogRow.waits_for,
    EventLogRow.token,
    EventLogRow.model,
)


class EventLog:
    """The index's event log (see the module doc), through the index's group commit. The index calls
    :meth:`stored`, :meth:`removed` and :meth:`config_removed` inside a change's transaction; the events wing
    (app/events) reads and writes the rest. ``enabled`` says whether changes write rows."""

    def __init__(self, commits: GroupCommit, *, enabled: bool) -> None:
        self._commits = commits
        self.enabled = enabled

    # -- in a change's transaction ----------------------------------------------------------------------------

    @functools.cached_property
    def _log_insert(self) -> Any:
        return insert(EventLogRow).values({name: bindparam(name) for name in _LOGGED})

    @functools.cached_property
    def _log_sqlite(self) -> str:
        """The insert as SQLite's own SQL, compiled once (run on the driver's cursor, as the swap is)."""
        compiled = self._log_insert.compile(dialect=self._commits.engine.dialect)
        if tuple(compiled.positiontup or ()) != _LOGGED:
            raise RuntimeError(f"event_log insert binds {compiled.positiontup}, expected {_LOGGED}")
        return str(compiled)

    def _log(self, conn: Connection, *, kind: int, key: str, size: int, digest: str, note: LogNote | None) -> None:
        """Add a change's row (only after the transaction has written: see Order in the module doc)."""
        if not self.enabled:
            return
        values = (
            kind,
            key,
            size,
            digest,
            None if note is None else note.meta,
            _join(note.waits_for) if note is not None and note.waits_for else None,
            None if note is None else note.token,
        )
        if self._commits.dialect == "sqlite":
            driver = conn.connection.dbapi_connection
            if driver is not None:
                driver.execute(self._log_sqlite, values)
                return
        conn.execute(self._log_insert, dict(zip(_LOGGED, values, strict=True)))

    def stored(self, conn: Connection, *, record: BlockRecord, swap: Swap, note: LogNote | None) -> None:
        """The row of a swap that wrote other bytes than the key's row held, or a new key (a re-stamp of the same
        bytes is not news)."""
        old = swap.old
        if swap.written and (old is None or (old.digest, old.size) != (record.digest, record.size)):
            self._log(conn, kind=STORED, key=record.key, size=record.size, digest=record.digest, note=note)

    def config_removed(self, conn: Connection, *, namespace: str, model: str) -> None:
        """The row of a namespace's config removed (a purge, after its blocks' rows): the model its config named."""
        if self.enabled:
            conn.execute(insert(EventLogRow).values(kind=CONFIG_REMOVED, key=namespace, size=0, digest="", model=model))

    def removed(self, conn: Connection, *, record: BlockRecord) -> None:
        """The row of a key's row removed (``record``: the row it held)."""
        self._log(conn, kind=REMOVED, key=record.key, size=record.size, digest=record.digest, note=None)

    async def release(self, key: str, *, token: int) -> None:
        """The PUT ``token`` of ``key`` ended without storing it while rows waited for it: they wait no more."""

        def run(conn: Connection) -> None:
            if self._commits.dialect == "postgresql":
                conn.execute(text("SELECT pg_current_xact_id()"))  # the transaction's id before the row's
            self._log(conn, kind=RELEASE, key=key, size=0, digest="", note=LogNote(token=token))

        await self._commits.write(run, point=True)

    # -- the publisher's reads ----------------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """What the reader may take (SQLite: every row; no query). PostgreSQL: the largest id visible, then a
        transaction id taken after it (``xmax``: every row up to that id was taken by an older transaction), then,
        once that transaction has ended, the oldest one running (``xmin``)."""
        postgres = self._commits.dialect == "postgresql"
        if not postgres:
            return Snapshot(xmin=0, xmax=0, max_id=1 << 62)

        def q(conn: Connection) -> Snapshot:
            max_id = int(conn.execute(text("SELECT max(id) FROM event_log")).scalar() or 0)
            bound = int(conn.execute(text("SELECT pg_current_xact_id()::text")).scalar_one())
            conn.rollback()  # it ends: every later snapshot lists each transaction older than it still running
            xmin = int(conn.execute(text("SELECT pg_snapshot_xmin(pg_current_snapshot())::text")).scalar_one())
            return Snapshot(xmin=xmin, xmax=bound, max_id=max_id)

        return await self._commits.read(q)

    async def head(self) -> int:
        """The largest id of a committed row (0: none)."""
        return int(await self._commits.read(lambda conn: conn.execute(select(func.max(EventLogRow.id))).scalar() or 0))

    async def config_model(self, namespace: str) -> str | None:
        """The model name the namespace's config gave when it was last removed, while that row is kept (None: no
        such row): the topic of the namespace's rows published after a purge removed its config."""
        stmt = (
            select(EventLogRow.model)
            .where(EventLogRow.kind == CONFIG_REMOVED, EventLogRow.key == namespace)
            .order_by(EventLogRow.id.desc())
            .limit(1)
        )
        model = await self._commits.read(lambda conn: conn.execute(stmt).scalar())
        return model if isinstance(model, str) else None

    async def rows(self, *, after: int, upto: int, limit: int) -> list[LogRow]:
        stmt = (
            select(*_COLUMNS)
            .where(EventLogRow.id > after, EventLogRow.id <= upto)
            .order_by(EventLogRow.id)
            .limit(limit)
        )
        return await self._commits.read(lambda conn: [_log_row(r) for r in conn.execute(stmt)])

    async def rows_by_id(self, ids: Sequence[int]) -> dict[int, LogRow]:
        stmt = select(*_COLUMNS).where(EventLogRow.id.in_(bindparam("ids", expanding=True)))

        def q(conn: Connection) -> dict[int, LogRow]:
            out: dict[int, LogRow] = {}
            for start in range(0, len(ids), ROWS_CHUNK):
                for r in conn.execute(stmt, {"ids": list(ids[start : start + ROWS_CHUNK])}):
                    out[int(r[0])] = _log_row(r)
            return out

        return await self._commits.read(q)

    async def state(self) -> LogState | None:
        def q(conn: Connection) -> LogState | None:
            row = conn.execute(select(EventState).where(EventState.name == STREAM)).first()
            return None if row is None else _state(row)

        return await self._commits.read(q)

    async def batches(self, *, since: int, limit: int) -> list[LoggedBatch]:
        """Stored batches numbered ``since`` or later, oldest first."""
        stmt = select(EventBatchRow).where(EventBatchRow.seq >= since).order_by(EventBatchRow.seq).limit(limit)
        return await self._commits.read(
            lambda conn: [LoggedBatch(seq=r.seq, ts=r.ts, topic=r.topic, ids=_ids(r.ids)) for r in conn.execute(stmt)]
        )

    async def first_seq(self) -> int | None:
        """The oldest batch number still stored (None: none is)."""
        first = await self._commits.read(lambda conn: conn.execute(select(func.min(EventBatchRow.seq))).scalar())
        return None if first is None else int(first)

    # -- the publisher's writes ---------------------------------------------------------------------------------

    async def init(self, *, first_seq: int) -> None:
        """Create the stream's state if it has none: its first batch will be numbered ``first_seq``."""

        def run(conn: Connection) -> None:
            ins = self._commits.dialect_insert(EventState).values(
                name=STREAM, term=0, next_seq=first_seq, last_id=0, held="", waiting="{}"
            )
            conn.execute(ins.on_conflict_do_nothing(index_elements=[EventState.name]))

        await self._commits.write(run)

    async def claim(self) -> LogState:
        """Take the next term (a publisher of an earlier one can write nothing more); the state it resumes from."""

        def run(conn: Connection) -> LogState:
            where = EventState.name == STREAM
            conn.execute(update(EventState).where(where).values(term=EventState.term + 1))
            return _state(conn.execute(select(EventState).where(where)).one())

        state: LogState = await self._commits.write(run)
        return state

    async def persist(
        self,
        *,
        term: int,
        batches: Sequence[LoggedBatch],
        next_seq: int,
        last_id: int,
        held: Sequence[int],
        waiting: Mapping[int, str],
        keep: int | None = None,
    ) -> bool:
        """Store ``batches`` with where the publisher now stands, in one transaction, if ``term`` is still the
        stream's (False: another publisher took over; nothing was written). ``keep``: also trim to the newest
        ``keep`` batches and the log rows they, and the rows held, need."""

        def run(conn: Connection) -> bool:
            moved = conn.execute(
                update(EventState)
                .where(EventState.name == STREAM, EventState.term == term)
                .values(
                    next_seq=next_seq,
                    last_id=last_id,
                    held=_join(held),
                    waiting=json.dumps({str(t): k for t, k in waiting.items()}),
                )
            )
            if moved.rowcount != 1:
                return False
            if batches:
                stored = [
                    {"seq": b.seq, "ts": b.ts, "topic": b.topic, "ids": _join(b.ids), "low": min(b.ids)}
                    for b in batches
                ]
                conn.execute(insert(EventBatchRow), stored)
            if keep is not None:
                conn.execute(delete(EventBatchRow).where(EventBatchRow.seq < next_seq - keep))
                low = conn.execute(select(func.min(EventBatchRow.low))).scalar()
                floor = min([last_id + 1, *held, *([int(low)] if low is not None else [])])
                conn.execute(delete(EventLogRow).where(EventLogRow.id < floor))
            return True

        return bool(await self._commits.write(run))


def _state(row: Any) -> LogState:
    waiting = {int(t): str(k) for t, k in json.loads(row.waiting or "{}").items()}
    return LogState(term=row.term, next_seq=row.next_seq, last_id=row.last_id, held=_ids(row.held), waiting=waiting)
