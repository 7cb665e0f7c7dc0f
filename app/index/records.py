"""What the index returns: plain frozen records, never ORM rows."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final, Literal


class _Expect(enum.Enum):
    ANY = "any"
    ABSENT = "absent"


ANY: Final = _Expect.ANY
"""A change that takes the key as it finds it (a PUT overwrites whatever is there)."""
ABSENT: Final = _Expect.ABSENT
"""A change that needs the key absent (create-only)."""
Expect = Literal[_Expect.ANY, _Expect.ABSENT] | str | None
"""What a change expects of the key's row: ANY, ABSENT, or the stamp of the version it observed (None: a row of an
earlier release, without a stamp)."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    key: str
    namespace: str
    rank: int
    group: int
    size: int
    digest: str
    created_at: float
    last_access: float
    hits: int
    stamp: str | None = None
    """The stored version the row describes (None: a row written before versions were recorded)."""
    chunk_bytes: int | None = None
    """The chunk size of ``chunk_sums`` (None: a row written before chunk checksums were recorded)."""
    chunk_sums: bytes | None = None
    """The CRC64NVME of each chunk of the version, 8 bytes each (app/storage/checksums.py's ``Chunks``)."""


@dataclass(frozen=True, slots=True)
class Swap:
    """What ``Index.swap_block`` found and did, in one transaction."""

    old: BlockRecord | None
    """The row before (None: the key was absent)."""
    written: bool
    """False when nothing changed: the row was not what the change expected, or it already held the same bytes."""
    fenced: bool = False
    """Nothing was written because the staged version's intent was gone: a sweep took it (app/index/staging.py)."""


@dataclass(frozen=True, slots=True)
class LogNote:
    """What a change's writer adds to its event-log row (app/index/eventlog.py): the block meta it sent, the PUTs of
    its parent it waits for, and the PUT's own token when children wait for it."""

    meta: str | None = None
    """The block meta the writer sent, in its one serialized form (``contract.wire.BlockMetaValue.header``): the
    index stores it as it is and never reads its fields. None: no block meta was sent."""
    waits_for: tuple[int, ...] = ()
    """The tokens of the PUTs of the parent in progress in the committing process that had not queued their change
    (each owes a row of the parent's key after this one: the row waits for them)."""
    token: int | None = None
    """The token of the PUT making this change, when children's rows wait for it."""


@dataclass(frozen=True, slots=True)
class PartRecord:
    """A stored byte range ``[start, end)`` of the object ``key`` of ``total`` bytes."""

    key: str
    start: int
    end: int
    total: int
    digest: str
    store_key: str
    created_at: float = 0.0
    """When the part was recorded (wall clock)."""


@dataclass(frozen=True, slots=True)
class NamespaceUsage:
    """Aggregates of one namespace's block rows (admin views, usage at start-up)."""

    namespace: str
    blocks: int
    bytes: int
    hits: int
    never_read: int
    last_write: float | None
    last_access: float | None


@dataclass(frozen=True, slots=True)
class Upload:
    """An incomplete multi-part object: its stored parts count against capacity until it completes or is dropped."""

    key: str
    namespace: str
    last_part_at: float
    """When its newest part was recorded (wall clock): an upload idle for long was abandoned by its writers."""
    bytes: int


@dataclass(frozen=True, slots=True)
class NamespaceRecord:
    name: str
    fields: dict[str, Any]
    created_at: float


def block_record(row: Any) -> BlockRecord:
    return BlockRecord(
        key=row.key,
        namespace=row.namespace,
        rank=row.rank,
        group=row.grp,
        size=row.size,
        digest=row.digest,
        created_at=row.created_at,
        last_access=row.last_access,
        hits=row.hits,
        stamp=row.stamp,
        chunk_bytes=row.chunk_bytes,
        chunk_sums=row.chunk_sums,
    )


def row_values(record: BlockRecord) -> dict[str, Any]:
    """A block row's column values (the model names the group column ``grp``)."""
    return {
        "key": record.key,
        "namespace": record.namespace,
        "rank": record.rank,
        "grp": record.group,
        "size": record.size,
        "digest": record.digest,
        "stamp": record.stamp,
        "created_at": record.created_at,
        "last_access": record.last_access,
        "hits": record.hits,
        "chunk_bytes": record.chunk_bytes,
        "chunk_sums": record.chunk_sums,
    }
