"""The model name in the event log: a namespace's config removed (a purge) leaves a row with the model its config
named, so that the rows of its blocks, published after the config is gone, still go out under the model's topic.

Plain ADD COLUMN (nullable, no rewrite): rows before this revision have none, as every block's row has; a partial
index of the config rows (the publisher looks one up by namespace).

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("event_log", sa.Column("model", sa.Text(), nullable=True))
    # the publisher looks a purged namespace's model up by its config's row: a partial index of those rows only
    where = sa.text("kind = 3")
    op.create_index("ix_event_log_config", "event_log", ["key"], sqlite_where=where, postgresql_where=where)


def downgrade() -> None:
    op.drop_index("ix_event_log_config", table_name="event_log")
    # SQLite rebuilds the table to drop a column: it must keep AUTOINCREMENT and the ids already handed out, or a
    # trimmed log hands out ids below the publisher's last one again (PostgreSQL's sequence is not touched)
    bind = op.get_bind()
    sqlite = bind.dialect.name == "sqlite"
    handed_out = _sqlite_sequence(bind) if sqlite else 0
    with op.batch_alter_table("event_log", table_kwargs={"sqlite_autoincrement": True}) as batch:
        batch.drop_column("model")
    if sqlite:
        seq = max(handed_out, _sqlite_sequence(bind))
        bind.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = 'event_log'"))
        bind.execute(sa.text("INSERT INTO sqlite_sequence (name, seq) VALUES ('event_log', :seq)"), {"seq": seq})


def _sqlite_sequence(bind: sa.Connection) -> int:
    """The last event-log id SQLite handed out (0: none yet)."""
    seq = bind.execute(sa.text("SELECT seq FROM sqlite_sequence WHERE name = 'event_log'")).scalar()
    return int(seq or 0)
