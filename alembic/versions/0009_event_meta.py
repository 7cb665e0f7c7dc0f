"""The block meta in the event log as one value: the header's own form (``parent=<hex>; tokens=1,2,3``, as
``contract.wire.BlockMetaValue.header`` writes it) in ``meta``, in place of 0006's column per field (``tokens``,
``parent``). A new field of the block meta then changes no table.

Existing rows move in one UPDATE (the same SQL on SQLite and PostgreSQL): NULL stays NULL (no meta was sent), a parent
and token ids become ``parent=<hex>; tokens=<ids>``, either alone its own part, and an empty token list with no parent
the empty value (a meta that said nothing, as before). Then the per-field columns go: PostgreSQL drops them in place;
SQLite rebuilds the table (batch mode), keeping AUTOINCREMENT and the ids already handed out, as 0007's downgrade does,
and the partial index of config rows is made again after the rebuild.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FOLD = """UPDATE event_log SET meta = CASE WHEN tokens IS NULL AND parent IS NULL THEN NULL ELSE
    COALESCE('parent=' || parent, '')
    || CASE WHEN parent IS NOT NULL AND tokens <> '' THEN '; ' ELSE '' END
    || CASE WHEN tokens <> '' THEN 'tokens=' || tokens ELSE '' END
  END"""
"""The header's form of 0006's columns (``tokens``: the ids comma-separated, '' for none; ``parent``: hex)."""


def upgrade() -> None:
    op.add_column("event_log", sa.Column("meta", sa.Text(), nullable=True))  # plain ADD COLUMN: no rebuild
    op.get_bind().execute(sa.text(FOLD))
    _drop_columns("tokens", "parent")


def downgrade() -> None:
    op.add_column("event_log", sa.Column("tokens", sa.Text(), nullable=True))
    op.add_column("event_log", sa.Column("parent", sa.String(128), nullable=True))
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT id, meta FROM event_log WHERE meta IS NOT NULL")).all()
    split = [{"id": row_id, **_fields(meta)} for row_id, meta in rows]
    if split:
        bind.execute(sa.text("UPDATE event_log SET tokens = :tokens, parent = :parent WHERE id = :id"), split)
    _drop_columns("meta")


def _fields(meta: str) -> dict[str, str | None]:
    """0006's columns of a stored meta (the grammar as 0009 knows it: a field it does not know is left out)."""
    fields: dict[str, str] = {}
    for part in meta.split(";"):
        name, _, value = part.strip().partition("=")
        fields[name] = value
    return {"tokens": fields.get("tokens", ""), "parent": fields.get("parent") or None}


def _drop_columns(*names: str) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        for name in names:
            op.drop_column("event_log", name)
        return
    # SQLite rebuilds the table to drop a column: it must keep AUTOINCREMENT and the ids already handed out, or a
    # trimmed log hands out ids below the publisher's last one again; the partial index is made again after it
    op.drop_index("ix_event_log_config", table_name="event_log")
    handed_out = _sqlite_sequence(bind)
    with op.batch_alter_table("event_log", table_kwargs={"sqlite_autoincrement": True}) as batch:
        for name in names:
            batch.drop_column(name)
    seq = max(handed_out, _sqlite_sequence(bind))
    bind.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = 'event_log'"))
    bind.execute(sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES ('event_log', :seq)"), {"seq": seq})
    where = sa.text("kind = 3")
    op.create_index("ix_event_log_config", "event_log", ["key"], sqlite_where=where)


def _sqlite_sequence(bind: sa.Connection) -> int:
    """The last event-log id SQLite handed out (0: none yet)."""
    seq = bind.execute(sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'event_log'")).scalar()
    return int(seq or 0)
